// The sluice inspector page: follows GET <base>/steps (server-sent events, read with fetch so that an API key
// can travel in the Authorization header) and polls GET <base>/kv. Plain script, no dependencies.
"use strict";

const BASE = location.pathname.replace(/\/+$/, ""); // ".../inspect", wherever the app is mounted
const MAX_RECORDS = 5000; // kept in memory (the engine keeps its own last 4096)
const MAX_ROWS = 1500; // step rows in the page
const KV_POLL_MS = 500;
const MAX_CELLS = 16384; // KV grid cells drawn

const S = {
  steps: [], // step records, oldest first (ids increase)
  rendered: 0, // step id of the newest row drawn
  cursor: null, // step id shown in the counters and the detail panel
  paused: false,
  selected: null, // request id
  hovered: null,
  kv: null,
  mode: "live",
  maxTokens: 1,
  key: new URLSearchParams(location.hash.slice(1)).get("key") || sessionStorage.getItem("sluice-inspector-key") || "",
  blocked: false, // waiting for an API key
};

const $ = (id) => document.getElementById(id);
const el = (tag, cls, text) => {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
};

function colour(rid) {
  let h = 0;
  for (let i = 0; i < rid.length; i++) h = (h * 31 + rid.charCodeAt(i)) >>> 0;
  return `hsl(${h % 360}, 62%, 58%)`;
}
const short = (rid) => (rid.length > 18 ? rid.slice(0, 9) + "\u2026" + rid.slice(-6) : rid);
const ms = (s) => (s * 1000).toFixed(s < 0.1 ? 1 : 0);
const pct = (x) => (100 * x).toFixed(2) + "%";

// -- data ----------------------------------------------------------------------------------------------
function headers() {
  return S.key ? { Authorization: "Bearer " + S.key } : {};
}

function needKey() {
  S.blocked = true;
  setStatus("API key needed", "bad");
  $("keyform").hidden = false;
  $("key").focus();
}

function setStatus(text, cls) {
  const s = $("status");
  s.textContent = text;
  s.className = "badge " + (cls || "");
}

async function follow() {
  for (;;) {
    if (!S.blocked) {
      try {
        const last = S.steps.length ? S.steps[S.steps.length - 1].step_id : 0;
        const resp = await fetch(`${BASE}/steps?since=${last}`, { headers: headers() });
        if (resp.status === 401) needKey();
        else if (!resp.ok) setStatus(`steps: HTTP ${resp.status}`, "bad");
        else await readEvents(resp);
      } catch (e) {
        setStatus("disconnected", "bad");
      }
    }
    await new Promise((r) => setTimeout(r, 1000));
  }
}

async function readEvents(resp) {
  setStatus("connected", "ok");
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += value.replace(/\r\n?/g, "\n");
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (event === "step" && data.length) addStep(JSON.parse(data.join("\n")));
    }
  }
  setStatus("reconnecting", "bad");
}

function addStep(rec) {
  const last = S.steps[S.steps.length - 1];
  if (last && rec.step_id <= last.step_id) return;
  S.steps.push(rec);
  if (S.steps.length > MAX_RECORDS) S.steps.splice(0, S.steps.length - MAX_RECORDS);
  S.maxTokens = Math.max(S.maxTokens, rec.num_tokens);
  scheduleRender();
}

async function pollKv() {
  for (;;) {
    if (!S.blocked && (!S.paused || !S.kv)) {
      try {
        const resp = await fetch(`${BASE}/kv`, { headers: headers() });
        if (resp.status === 401) needKey();
        else if (resp.ok) {
          S.kv = await resp.json();
          S.mode = S.kv.mode;
          $("mode").textContent = S.mode === "trace" ? "recorded trace" : "live engine";
          $("model").textContent = S.kv.model || "";
          drawKv();
          if (S.mode === "trace") return; // a trace's snapshot never changes
        }
      } catch (e) {
        /* the steps stream reports the connection state */
      }
    }
    await new Promise((r) => setTimeout(r, KV_POLL_MS));
  }
}

// -- steps -----------------------------------------------------------------------------------------------
let renderTimer = null;
function scheduleRender() {
  if (renderTimer === null) renderTimer = setTimeout(render, 60);
}

function render() {
  renderTimer = null;
  if (!S.paused) {
    appendRows();
    if (S.steps.length) S.cursor = S.steps[S.steps.length - 1].step_id;
  }
  showCursor();
}

function appendRows() {
  const box = $("steps");
  const frag = document.createDocumentFragment();
  for (const rec of S.steps) {
    if (rec.step_id <= S.rendered) continue;
    frag.prepend(stepRow(rec));
    S.rendered = rec.step_id;
  }
  box.prepend(frag);
  while (box.childElementCount > MAX_ROWS) box.lastElementChild.remove();
}

function stepRow(rec) {
  const row = el("div", "step");
  row.dataset.step = rec.step_id;
  row.append(el("span", "sid", rec.step_id));
  const bar = el("div", "bar");
  const scale = $("fit").checked ? S.maxTokens : rec.token_budget;
  bar.title = `${rec.num_tokens} / ${rec.token_budget} tokens`;
  for (const r of rec.requests) {
    const parts = [[r.kind, r.num_tokens]];
    if (r.num_draft_tokens) parts.push(["draft", r.num_draft_tokens]);
    for (const [kind, n] of parts) {
      const seg = el("span", "seg " + kind);
      seg.dataset.rid = r.request_id;
      seg.dataset.kind = kind;
      seg.dataset.tokens = n;
      seg.style.flexBasis = (100 * n) / scale + "%";
      seg.style.borderTopColor = colour(r.request_id);
      if (r.request_id === S.selected) seg.classList.add("sel");
      seg.title = segTitle(r, kind, n);
      bar.append(seg);
    }
  }
  row.append(bar);
  row.append(el("span", "dur", ms(rec.duration_s) + " ms"));
  const marks = el("span", "marks");
  if (rec.num_preempted) {
    const m = el("span", "pre", "\u27f2 " + rec.num_preempted);
    m.title = "preempted: " + (rec.preempted.join(", ") || "?");
    marks.append(m);
  }
  const fin = Object.keys(rec.finished);
  if (fin.length) {
    const m = el("span", "fin", "\u2713 " + fin.length);
    m.title = "finished: " + fin.map((k) => `${k} (${rec.finished[k]})`).join(", ");
    marks.append(m);
  }
  row.append(marks);
  return row;
}

function segTitle(r, kind, n) {
  if (kind === "draft") return `${r.request_id}\n${n} draft tokens verified, ${r.num_accepted_tokens} accepted`;
  let t = `${r.request_id}\n${kind} ${n} tokens at positions ${r.start_pos}..${r.start_pos + n - 1}`;
  if (r.num_cached_tokens) t += `\n${r.num_cached_tokens} prompt tokens from the prefix cache`;
  if (r.num_output_tokens) t += `\nemitted ${r.num_output_tokens}`;
  return t;
}

function indexOf(stepId) {
  let lo = 0, hi = S.steps.length - 1;
  while (lo <= hi) {
    const mid = (lo + hi) >> 1;
    const id = S.steps[mid].step_id;
    if (id === stepId) return mid;
    if (id < stepId) lo = mid + 1;
    else hi = mid - 1;
  }
  return -1;
}

function showCursor() {
  const i = indexOf(S.cursor);
  if (i < 0) return;
  const rec = S.steps[i];
  $("cursor").textContent = `step ${rec.step_id}`;
  document.querySelectorAll(".step.cur").forEach((r) => r.classList.remove("cur"));
  const row = document.querySelector(`.step[data-step="${rec.step_id}"]`);
  if (row) {
    row.classList.add("cur");
    if (S.paused) row.scrollIntoView({ block: "nearest" });
  }
  counters(i);
  detail(rec);
}

// -- counters ----------------------------------------------------------------------------------------------
function quantiles(xs) {
  if (!xs.length) return "\u2013";
  xs.sort((a, b) => a - b);
  const q = (p) => xs[Math.min(xs.length - 1, Math.round(p * (xs.length - 1)))];
  return `${ms(q(0.5))} / ${ms(q(0.9))} / ${ms(q(0.99))} ms`;
}

function spark(svg, values) {
  const n = values.length;
  if (n < 2) return (svg.innerHTML = "");
  const pts = values.map((v, j) => `${((120 * j) / (n - 1)).toFixed(1)},${(23 - 22 * v).toFixed(1)}`);
  svg.innerHTML = `<polyline points="${pts.join(" ")}"/>`;
}

function counters(i) {
  const r = S.steps[i];
  $("c-queue").textContent = `${r.num_running} / ${r.num_waiting}`;
  const usage = (rec) => (rec.kv_blocks_total ? 1 - rec.kv_blocks_free / rec.kv_blocks_total : 0);
  const hit = (rec) => (rec.prefix_cache_queries ? rec.prefix_cache_hits / rec.prefix_cache_queries : 0);
  $("c-kv").textContent = pct(usage(r));
  const h = $("c-hit");
  h.textContent = pct(hit(r));
  h.dataset.hits = r.prefix_cache_hits;
  h.dataset.queries = r.prefix_cache_queries;
  $("c-hit-tokens").textContent = `${r.prefix_cache_hits} / ${r.prefix_cache_queries} tokens`;
  $("c-spec").textContent = r.spec_num_drafts ? (1 + r.spec_num_accepted_tokens / r.spec_num_drafts).toFixed(2) : "\u2013";
  const upto = S.steps.slice(0, i + 1);
  $("c-ttft").textContent = quantiles(upto.flatMap((x) => x.ttft_s));
  $("c-itl").textContent = quantiles(upto.flatMap((x) => x.itl_s));
  $("c-steps").textContent = `${r.step_id} \u00b7 ${r.num_preemptions}`;
  $("c-cost").textContent = `recorder ${ms(r.recorder_s)} ms in all`;
  const recent = S.steps.slice(Math.max(0, i - 199), i + 1);
  spark($("spark-kv"), recent.map(usage));
  spark($("spark-hit"), recent.map(hit));
}

// -- detail ------------------------------------------------------------------------------------------------
function ridLink(rid) {
  const a = el("span", "rid", short(rid));
  a.title = rid;
  a.dataset.rid = rid;
  return a;
}

function detail(rec) {
  const box = $("detail");
  box.replaceChildren();
  const h = el("h2", null, `Step ${rec.step_id}: ${rec.num_tokens} / ${rec.token_budget} tokens in ${ms(rec.duration_s)} ms, at t = ${rec.t.toFixed(2)} s`);
  box.append(h);
  const table = el("table");
  const head = el("tr");
  for (const c of ["request", "kind", "tokens", "drafts (accepted)", "positions", "from cache", "emitted", "forks", "grammar"]) head.append(el("th", null, c));
  table.append(head);
  for (const r of rec.requests) {
    const tr = el("tr", r.request_id === S.selected ? "sel" : "");
    const cells = [
      null, r.kind, r.num_tokens, r.num_draft_tokens ? `${r.num_draft_tokens} (${r.num_accepted_tokens})` : "",
      `${r.start_pos}..${r.start_pos + r.num_tokens + r.num_draft_tokens - 1}`, r.num_cached_tokens || "",
      r.num_output_tokens || "", r.forks.length || "", r.constrained ? "yes" : "",
    ];
    const first = el("td");
    first.append(ridLink(r.request_id));
    tr.append(first);
    for (const c of cells.slice(1)) tr.append(el("td", null, c));
    table.append(tr);
  }
  box.append(table);
  const notes = [];
  if (rec.num_preempted) notes.push(`preempted: ${rec.preempted.join(", ") || rec.num_preempted}`);
  const fin = Object.entries(rec.finished);
  if (fin.length) notes.push("finished: " + fin.map(([k, v]) => `${k} (${v})`).join(", "));
  for (const n of notes) box.append(el("p", null, n));
  if (S.selected) box.append(requestSummary(S.selected));
}

function requestSummary(rid) {
  let steps = 0, prefill = 0, decode = 0, drafts = 0, accepted = 0, cached = 0, end = null;
  for (const rec of S.steps) {
    for (const r of rec.requests) {
      if (r.request_id !== rid) continue;
      steps++;
      if (r.kind === "prefill") prefill += r.num_tokens;
      else decode += r.num_tokens;
      drafts += r.num_draft_tokens;
      accepted += r.num_accepted_tokens;
      cached += r.num_cached_tokens;
    }
    if (rec.finished[rid]) end = `${rec.finished[rid]} at step ${rec.step_id}`;
  }
  const p = el("p", "summary");
  p.dataset.rid = rid;
  p.textContent =
    `Request ${rid}: in ${steps} recorded steps; prefill ${prefill} tokens (${cached} more from the prefix cache), ` +
    `decode ${decode}` + (drafts ? `, drafts ${drafts} (${accepted} accepted)` : "") + (end ? `; finished: ${end}` : "");
  return p;
}

// -- KV blocks ---------------------------------------------------------------------------------------------
function drawKv() {
  const kv = S.kv;
  const grid = $("kv-grid");
  const n = Math.min(kv.num_blocks, MAX_CELLS);
  if (grid.childElementCount !== n) {
    grid.replaceChildren();
    for (let b = 0; b < n; b++) {
      const c = el("div", "blk");
      c.dataset.block = b;
      grid.append(c);
    }
  }
  let cachedFree = 0, shared = 0;
  for (let b = 0; b < n; b++) {
    const c = grid.children[b];
    const ref = kv.ref_cnt[b], cached = kv.cached[b], owners = kv.owners[b] || [];
    c.className = "blk " + (ref > 0 ? "used" : cached ? "cached" : "free") + (ref > 1 ? " shared" : "");
    c.dataset.ref = ref;
    c.dataset.owners = owners.join(" ");
    c.style.background = ref > 0 && owners.length ? colour(owners[0]) : "";
    c.textContent = ref > 1 ? ref : "";
    c.title = `block ${b}: refcount ${ref}${cached ? ", cached" : ""}${ref ? "" : ", free"}` + (owners.length ? "\n" + owners.join("\n") : "");
    if (ref === 0 && cached) cachedFree++;
    if (ref > 1) shared++;
  }
  const used = kv.num_blocks - kv.num_free_blocks;
  $("kv-info").textContent =
    `${kv.num_blocks} blocks of ${kv.block_size} tokens: ${used} held (${shared} shared), ${cachedFree} cached and free, ` +
    `snapshot after step ${kv.step_id}` + (kv.num_blocks > n ? ` (first ${n} drawn)` : "");
  const list = $("kv-requests");
  list.replaceChildren();
  for (const [rid, info] of Object.entries(kv.requests)) {
    const item = el("span", "kvreq" + (rid === S.selected ? " sel" : ""));
    item.dataset.rid = rid;
    const dot = el("i");
    dot.style.background = colour(rid);
    item.append(dot, `${short(rid)} \u00b7 ${info.block_table.length} blocks \u00b7 ${info.num_computed_tokens}/${info.num_tokens} tok`);
    item.title = rid;
    list.append(item);
  }
  highlight(S.hovered || S.selected);
}

function highlight(rid) {
  const grid = $("kv-grid");
  grid.querySelectorAll(".hl").forEach((c) => c.classList.remove("hl"));
  const info = rid && S.kv && S.kv.requests[rid];
  const table = $("kv-table");
  table.replaceChildren();
  grid.classList.toggle("dim", !!info);
  if (!info) return;
  table.append(el("b", null, `${short(rid)} block table (logical \u2192 physical): `));
  info.block_table.forEach((b, i) => {
    const m = el("span", "map", `${i}\u2192${b}`);
    m.dataset.logical = i;
    m.dataset.physical = b;
    table.append(m);
    const c = grid.children[b];
    if (c) c.classList.add("hl");
  });
}

// -- interaction -------------------------------------------------------------------------------------------
function select(rid) {
  S.selected = S.selected === rid ? null : rid;
  $("steps").classList.toggle("has-sel", !!S.selected);
  document.querySelectorAll(".seg.sel").forEach((s) => s.classList.remove("sel"));
  if (S.selected) document.querySelectorAll(`.seg[data-rid="${CSS.escape(S.selected)}"]`).forEach((s) => s.classList.add("sel"));
  document.querySelectorAll(".kvreq").forEach((k) => k.classList.toggle("sel", k.dataset.rid === S.selected));
  highlight(S.selected);
  showCursor();
}

function setPaused(p) {
  S.paused = p;
  $("pause").textContent = p ? "Resume" : "Pause";
  $("pause").classList.toggle("on", p);
  if (!p) render();
}

function move(delta) {
  if (!S.steps.length) return;
  setPaused(true);
  const i = Math.max(0, Math.min(S.steps.length - 1, indexOf(S.cursor) + delta));
  S.cursor = S.steps[i].step_id;
  showCursor();
}

$("pause").onclick = () => setPaused(!S.paused);
$("back").onclick = () => move(-1);
$("fwd").onclick = () => move(1);
$("latest").onclick = () => setPaused(false);
$("fit").onchange = () => {
  $("steps").replaceChildren();
  S.rendered = 0;
  appendRows();
  showCursor();
};
$("keyform").onsubmit = (e) => {
  e.preventDefault();
  S.key = $("key").value;
  sessionStorage.setItem("sluice-inspector-key", S.key);
  $("keyform").hidden = true;
  S.blocked = false;
};
$("steps").onclick = (e) => {
  const seg = e.target.closest(".seg");
  const row = e.target.closest(".step");
  if (row) {
    setPaused(true);
    S.cursor = Number(row.dataset.step);
  }
  if (seg) select(seg.dataset.rid);
  else showCursor();
};
$("detail").onclick = (e) => {
  const r = e.target.closest(".rid");
  if (r) select(r.dataset.rid);
};
$("kv-requests").onclick = (e) => {
  const r = e.target.closest(".kvreq");
  if (r) select(r.dataset.rid);
};
$("kv-requests").onmouseover = (e) => {
  const r = e.target.closest(".kvreq");
  if (r && r.dataset.rid !== S.hovered) {
    S.hovered = r.dataset.rid;
    highlight(S.hovered);
  }
};
$("kv-requests").onmouseleave = () => {
  S.hovered = null;
  highlight(S.selected);
};
document.addEventListener("keydown", (e) => {
  if (e.target.tagName === "INPUT") return;
  if (e.key === " ") setPaused(!S.paused);
  else if (e.key === "ArrowLeft") move(-1);
  else if (e.key === "ArrowRight") move(1);
  else if (e.key === "End") setPaused(false);
  else return;
  e.preventDefault();
});

pollKv();
follow();
