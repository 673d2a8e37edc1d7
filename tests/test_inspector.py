"""The engine inspector: step records (against the scheduler's own accounting), KV snapshots, the /inspect
endpoints (schemas, API key, malformed parameters), and traces from `serve` and `cache-sim`. Fast: the
random-weight model and the model-free cache simulator. The browser test is in test_inspector_e2e.py."""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, ConfigDict
from sluice.app.bench.workloads import shared_prefix
from sluice.app.commands.cache_sim import SimConfig, simulate
from sluice.app.commands.cli import main
from sluice.app.inspector.trace import load_trace, step_dict
from sluice.app.inspector.web import build_trace_app
from sluice.app.server.app import build_app
from sluice.core import AsyncEngine, EngineArgs, SamplingParams
from sluice.core.engine_core.inspector import StepRecorder
from sluice.core.errors import InvalidRequestError
from sluice.core.frontend.request_actor import RequestLimits, make_requests
from sluice.core.sched.scheduler import Scheduler, SchedulerConfig
from sluice.kv.manager import KVCacheManager
from starlette.testclient import TestClient

from tests.helpers import fake_output
from tests.server_helpers import ServerThread, assert_openai_error, read_sse_events

KEY = "inspector-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SYSTEM = {"role": "system", "content": "You answer questions about rivers, briefly and kindly. " * 6}


# -- the wire schemas, written independently of the implementation ---------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StepRequestModel(_Strict):
    request_id: str
    kind: Literal["prefill", "decode"]
    num_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    start_pos: int
    num_cached_tokens: int
    num_output_tokens: int
    forks: list[str]
    constrained: bool


class StepModel(_Strict):
    step_id: int
    t: float
    duration_s: float
    token_budget: int
    num_tokens: int
    requests: list[StepRequestModel]
    preempted: list[str]
    num_preempted: int
    finished: dict[str, Literal["stop", "length", "abort"]]
    num_running: int
    num_waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    spec_num_drafts: int
    spec_num_accepted_tokens: int
    ttft_s: list[float]
    itl_s: list[float]
    recorder_s: float


class KVRequestModel(_Strict):
    block_table: list[int]
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int


class KVModel(_Strict):
    mode: Literal["live", "trace"]
    model: str
    step_id: int
    block_size: int
    num_blocks: int
    num_free_blocks: int
    ref_cnt: list[int]
    cached: list[bool]
    owners: dict[str, list[str]]
    requests: dict[str, KVRequestModel]


def check_kv(body: dict) -> KVModel:
    kv = KVModel.model_validate(body)
    assert len(kv.ref_cnt) == len(kv.cached) == kv.num_blocks
    assert kv.num_free_blocks == sum(r == 0 for r in kv.ref_cnt)
    for b, rids in kv.owners.items():  # every reference is a running request's table entry
        assert kv.ref_cnt[int(b)] == len(rids) > 0
        assert all(int(b) in kv.requests[rid].block_table for rid in rids)
    assert sum(kv.ref_cnt) == sum(len(r.block_table) for r in kv.requests.values())
    return kv


# -- records against the scheduler, through the model-free replay ------------------------------------------
def per_request(steps: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = defaultdict(lambda: defaultdict(int))
    for rec in steps:
        for r in rec["requests"]:
            acc = out[r["request_id"]]
            acc[r["kind"]] += r["num_tokens"]
            acc["cached"] += r["num_cached_tokens"]
            acc["emitted"] += r["num_output_tokens"]
        for rid, reason in rec["finished"].items():
            out[rid]["finished:" + reason] += 1
    return out


def test_cache_sim_trace_accounts_for_every_token(tmp_path):
    w = shared_prefix(groups=2, prompts_per_group=3, system_len=40, question_len=5, output_len=3)
    path = tmp_path / "sim.jsonl"
    res = simulate(w, SimConfig(num_kv_blocks=64, block_size=16, max_num_batched_tokens=64), trace=str(path))
    trace = load_trace(str(path))
    assert trace.meta["source"] == "cache-sim" and trace.meta["num_blocks"] == 64
    steps = trace.steps
    for rec in steps:
        StepModel.model_validate(rec)
        assert rec["num_tokens"] == sum(r["num_tokens"] + r["num_draft_tokens"] for r in rec["requests"])
        assert 0 < rec["num_tokens"] <= rec["token_budget"] == 64
        assert rec["duration_s"] == pytest.approx(0.02 + 0.0005 * rec["num_tokens"])  # the virtual clock
    assert [r["step_id"] for r in steps] == list(range(1, res.num_steps + 1))
    last = steps[-1]
    assert last["prefix_cache_queries"] == res.prefix_cache_queries
    assert last["prefix_cache_hits"] == res.prefix_cache_hits
    assert res.prefix_cache_hits > 0 and res.num_preemptions == 0
    acc = per_request(steps)
    assert len(acc) == 6
    for i, wr in enumerate(w.requests):
        a = acc[f"sim-{i}"]
        # a budget of 64 cuts the 45-token prompts into chunks; hits are never computed
        assert a["prefill"] + a["cached"] == len(wr.prompt_token_ids)
        assert a["decode"] == wr.output_len - 1 and a["emitted"] == wr.output_len
        assert a["finished:length"] == 1
    assert sum(a["cached"] for a in acc.values()) == res.prefix_cache_hits
    assert sum(len(r["ttft_s"]) for r in steps) == 6
    assert sum(len(r["itl_s"]) for r in steps) == 6 * 2
    kv = check_kv({"mode": "trace", "model": "", **trace.kv})
    assert kv.requests == {} and kv.num_free_blocks == 64 and any(kv.cached)


def test_preemptions_are_recorded_with_their_requests(tmp_path):
    w = shared_prefix(groups=4, prompts_per_group=2, system_len=30, question_len=4, output_len=40)
    path = tmp_path / "sim.jsonl"
    res = simulate(w, SimConfig(num_kv_blocks=12, block_size=8), trace=str(path))
    steps = load_trace(str(path)).steps
    assert res.num_preemptions > 0
    assert sum(r["num_preempted"] for r in steps) == res.num_preemptions == steps[-1]["num_preemptions"]
    preempted = [(rec["step_id"], rid) for rec in steps for rid in rec["preempted"]]
    assert len(preempted) == res.num_preemptions
    for step_id, rid in preempted:  # it comes back later and recomputes from its prefix-cache hit
        later = [r for rec in steps if rec["step_id"] > step_id for r in rec["requests"] if r["request_id"] == rid]
        assert later and later[0]["kind"] == "prefill" and later[0]["start_pos"] == later[0]["num_cached_tokens"]


def test_kv_snapshot_shows_the_shared_prefix_blocks():
    kv = KVCacheManager(32, 16)
    sched = Scheduler(SchedulerConfig(8, 256, 512, 16), kv)
    rec = StepRecorder(sched)
    limits = RequestLimits(512, 1000, 32 * 16)
    shared = list(range(100, 148))  # three full blocks
    a, b = (
        make_requests(rid, shared + [200 + j, 201, 202, 203, 204], SamplingParams(max_tokens=4), (), limits)[0]
        for j, rid in enumerate("ab")
    )
    rec.admitted([a, b])
    sched.add_request(a)
    sched.add_request(b)
    records = []
    for _ in range(2):
        mark = rec.begin()
        so = sched.schedule()
        out = fake_output(so)
        records.append(rec.record(mark, so, out, sched.update_from_output(so, out)))
    # step 1 computes a's prompt; b waits for a's blocks instead of computing them too, and hits in step 2
    assert [(r.request_id, r.kind, r.num_tokens) for r in records[0].requests] == [("a", "prefill", 53)]
    assert [(r.request_id, r.kind, r.num_tokens, r.num_cached_tokens) for r in records[1].requests] == [
        ("a", "decode", 1, 0),
        ("b", "prefill", 5, 48),
    ]
    snap = check_kv({"mode": "live", "model": "", **rec.kv_snapshot()})
    ta, tb = snap.requests["a"].block_table, snap.requests["b"].block_table
    assert ta == kv.block_table("a") and tb == kv.block_table("b")
    assert ta[:3] == tb[:3] and ta[3] != tb[3]
    for blk in ta[:3]:
        assert snap.ref_cnt[blk] == 2 and snap.owners[str(blk)] == ["a", "b"] and snap.cached[blk]
    assert snap.ref_cnt[ta[3]] == 1 and not snap.cached[ta[3]]
    assert snap.step_id == 2 and records[1].prefix_cache_hits == 48


def test_the_ring_buffer_is_bounded_and_since_pages_it():
    sched = Scheduler(SchedulerConfig(8, 64, 256, 16), KVCacheManager(16, 16))
    rec = StepRecorder(sched, max_steps=5)
    limits = RequestLimits(256, 1000, 256)
    (req,) = make_requests("r", list(range(10)), SamplingParams(max_tokens=9, ignore_eos=True), (), limits)
    rec.admitted([req])
    sched.add_request(req)
    while sched.has_work():
        mark = rec.begin()
        so = sched.schedule()
        out = fake_output(so, 5)
        rec.record(mark, so, out, sched.update_from_output(so, out))
    assert [r.step_id for r in rec.steps] == [5, 6, 7, 8, 9]
    assert [r.step_id for r in rec.since(0)] == [5, 6, 7, 8, 9]
    assert [r.step_id for r in rec.since(7)] == [8, 9] and rec.since(9) == []
    assert rec.steps[-1].finished == {"r": "length"}
    assert rec._arrival == {} and rec._last_output == {}  # nothing kept of a finished request


# -- the live server ---------------------------------------------------------------------------------------
def dummy_args(**kw) -> EngineArgs:
    base = dict(model="dummy:tiny", device="cpu", num_kv_blocks=96, max_model_len=512, enable_inspector=True)
    return EngineArgs(**{**base, **kw})


@pytest.fixture(scope="module")
def server():
    engine = AsyncEngine(dummy_args())
    srv = ServerThread(build_app(engine, api_key=KEY)).start()
    srv.engine = engine
    yield srv
    srv.stop()


def chat_concurrently(url: str, n: int, max_tokens: int = 4) -> list[dict]:
    results: list[dict] = [{}] * n

    def one(i: int) -> None:
        body = {"messages": [SYSTEM, {"role": "user", "content": f"River {i}?"}], "max_tokens": max_tokens}
        with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
            results[i] = c.post("/v1/chat/completions", json=body).json()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_page_and_assets_are_served_without_a_key(server):
    with httpx.Client(base_url=server.url) as c:
        page = c.get("/inspect")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'src="inspect/inspector.js"' in page.text and 'href="inspect/inspector.css"' in page.text
        js, css = c.get("/inspect/inspector.js"), c.get("/inspect/inspector.css")
        assert js.status_code == css.status_code == 200
        assert "/steps?since=" in js.text and "text/javascript" in js.headers["content-type"]
        assert ".blk.shared" in css.text
        assert "http" not in css.text and "//cdn" not in js.text  # self-contained


def test_data_endpoints_take_the_api_key(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        for path in ("/inspect/kv", "/inspect/steps"):
            assert_openai_error(c.get(path), 401)
            assert_openai_error(c.get(path, headers={"Authorization": "Bearer wrong"}), 401)


def test_steps_stream_matches_the_engine_records(server):
    results = chat_concurrently(server.url, 3)
    ids = {r["id"] for r in results}
    records = [step_dict(r) for r in server.engine.inspector.steps]
    assert records and ids <= {r["request_id"] for rec in records for r in rec["requests"]}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=10) as c:
        with c.stream("GET", "/inspect/steps") as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            events = read_sse_events(resp, len(records))
        assert [e["event"] for e in events] == ["step"] * len(records)
        got = [json.loads(e["data"]) for e in events]
        for e, rec in zip(events, got):
            StepModel.model_validate(rec)
            assert e["id"] == str(rec["step_id"])
        assert got == records
        # resuming: ?since= and the Last-Event-ID header of a dropped stream give only what came after
        mid = records[len(records) // 2]["step_id"]
        for kw in ({"params": {"since": mid}}, {"headers": {"Last-Event-ID": str(mid)}}):
            with c.stream("GET", "/inspect/steps", **kw) as resp:
                assert [json.loads(e["data"]) for e in read_sse_events(resp, 1)] == [
                    r for r in records if r["step_id"] > mid
                ][:1]
    finished = {rid for rec in records for rid in rec["finished"]}
    assert ids <= finished


def test_steps_stream_follows_new_steps(server):
    last = server.engine.inspector.steps[-1].step_id if server.engine.inspector.steps else 0
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        with c.stream("GET", "/inspect/steps", params={"since": last}) as resp:
            done = threading.Thread(target=chat_concurrently, args=(server.url, 1, 2))
            done.start()
            (event,) = read_sse_events(resp, 1)
            done.join()
    rec = StepModel.model_validate_json(event["data"])
    assert rec.step_id > last and rec.requests[0].kind == "prefill"


def test_kv_snapshot_schema_after_requests(server):
    chat_concurrently(server.url, 2)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=10) as c:
        resp = c.get("/inspect/kv")
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    kv = check_kv(resp.json())
    assert kv.mode == "live" and kv.model == "dummy:tiny" and kv.num_blocks == 96 and kv.block_size == 16
    assert kv.step_id == server.engine.stats().num_steps
    # done: nothing is held, but the shared system prompt's blocks stay cached for the next request
    assert kv.num_free_blocks == 96 and kv.requests == {} and sum(kv.cached) >= 4


@pytest.mark.parametrize(
    "path, params, param",
    [
        ("/inspect/steps", "since=abc", "since"),
        ("/inspect/steps", "since=-1", "since"),
        ("/inspect/steps", "since=1.5", "since"),
        ("/inspect/steps", "since=", "since"),
        ("/inspect/steps", "since=1&since=2", "since"),
        ("/inspect/steps", "sinse=1", "sinse"),
        ("/inspect/kv", "step=3", "step"),
    ],
)
def test_malformed_query_parameters_get_400(server, path, params, param):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=10) as c:
        err = assert_openai_error(c.get(f"{path}?{params}"), 400, param)
        assert err["type"] == "invalid_request_error"
        bad_header = c.get("/inspect/steps", headers={"Last-Event-ID": "x"})
        assert_openai_error(bad_header, 400, "Last-Event-ID")


def test_inspector_off_has_no_routes_and_no_recorder():
    engine = AsyncEngine(dummy_args(enable_inspector=False))
    assert engine.inspector is None
    client = TestClient(build_app(engine))  # no lifespan: routes only
    assert_openai_error(client.get("/inspect"), 404)
    assert_openai_error(client.get("/inspect/kv"), 404)
    with pytest.raises(InvalidRequestError, match="record_trace"):
        build_app(engine, record_trace="x.jsonl")


# -- traces ------------------------------------------------------------------------------------------------
def test_serve_records_a_trace_and_inspect_serves_it(tmp_path):
    path = tmp_path / "serve.jsonl"
    engine = AsyncEngine(dummy_args())
    srv = ServerThread(build_app(engine, record_trace=str(path))).start()
    try:
        chat_concurrently(srv.url, 3)
        records = [step_dict(r) for r in engine.inspector.steps]
    finally:
        srv.stop()
    trace = load_trace(str(path))
    assert trace.meta["source"] == "serve" and trace.meta["model"] == "dummy:tiny"
    assert trace.steps == records
    assert trace.kv is not None and trace.kv["step_id"] == records[-1]["step_id"]

    viewer = ServerThread(build_trace_app(str(path))).start()
    try:
        with httpx.Client(base_url=viewer.url, timeout=10) as c:
            assert c.get("/inspect").status_code == 200
            with c.stream("GET", "/inspect/steps") as resp:
                got = [json.loads(e["data"]) for e in read_sse_events(resp, len(records))]
            assert got == records
            kv = check_kv(c.get("/inspect/kv").json())
            assert kv.mode == "trace" and kv.model == "dummy:tiny" and kv.num_free_blocks == kv.num_blocks
            assert_openai_error(c.get("/inspect/steps?since=x"), 400, "since")
    finally:
        viewer.stop()


def test_a_served_trace_replays_in_cache_sim_with_the_engines_hit_rate(tmp_path, capsys):
    """`sluice serve --record-trace` -> `sluice cache-sim --trace`: the requests come back as they were served
    (prompt ids, reply lengths, tenants), and replayed one at a time with their recorded replies on the same pool,
    the simulator's hits are the engine's, tenant by tenant."""
    import openai
    from sluice.app.bench.workloads import load_trace as load_workload
    from sluice.core.frontend.tokenizer import apply_chat_template

    path = tmp_path / "serve.jsonl"
    engine = AsyncEngine(dummy_args(num_kv_blocks=64))
    srv = ServerThread(build_app(engine, record_trace=str(path))).start()
    system = {"role": "system", "content": "You answer questions about rivers, briefly and politely. " * 3}
    sent = []
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        for i, (question, salt) in enumerate([("Nile?", None), ("Amazon?", None), ("Nile?", "b"), ("Rhine?", "b")]):
            messages = [system, {"role": "user", "content": question}]
            resp = client.chat.completions.create(
                model="dummy:tiny", messages=messages, max_tokens=3 + i, temperature=0,
                extra_body={"cache_salt": salt, "ignore_eos": True},
            )  # fmt: skip
            sent.append((apply_chat_template(engine.tokenizer, messages), resp.usage.completion_tokens, salt))
        served = engine.stats()
    finally:
        srv.stop()

    trace = load_workload(path)
    assert [(r.prompt_token_ids, r.output_len, r.cache_salt) for r in trace.requests] == sent
    arrivals = [r.arrival_time for r in trace.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0
    replay = simulate(trace, SimConfig(num_kv_blocks=64, max_concurrency=1, recorded_replies=True))
    assert (replay.prefix_cache_hits, replay.prefix_cache_queries) == (
        served.prefix_cache_hits,
        served.prefix_cache_queries,
    )
    assert served.prefix_cache_hits > 0 and replay.tenants["b"].hit_tokens > 0  # its second request hits its first
    assert load_trace(str(path)).steps  # the same file still opens in `sluice inspect`

    argv = ["cache-sim", "--trace", str(path), "--model", "dummy:tiny", "--pool-blocks", "64"]
    assert main([*argv, "--max-concurrency", "1", "--recorded-replies"]) == 0
    out = capsys.readouterr().out
    assert f"{100 * served.prefix_cache_hits / served.prefix_cache_queries:.2f}%" in out
    assert "per tenant" in out and "(no salt)" in out


def test_cache_sim_command_records_one_configuration(tmp_path, capsys):
    path = tmp_path / "sim.jsonl"
    argv = ["cache-sim", "--groups", "2", "--prompts-per-group", "2", "--system-len", "32", "--question-len", "4"]
    argv += ["--output-len", "2", "--model", "dummy:tiny"]
    assert main([*argv, "--record-trace", str(path)]) == 2
    assert "one --pool-blocks" in capsys.readouterr().err
    assert main([*argv, "--pool-blocks", "40", "--record-trace", str(path)]) == 0
    assert "sluice inspect --trace" in capsys.readouterr().out
    trace = load_trace(str(path))
    assert trace.meta["num_blocks"] == 40 and len(trace.steps) > 0 and trace.kv["num_blocks"] == 40


def test_a_file_that_is_not_a_trace_is_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "step", "step_id": 1}\n')
    with pytest.raises(ValueError, match="no meta line"):
        load_trace(str(bad))
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_trace(str(bad))


def test_bench_throughput_measures_the_inspector_overhead(tmp_path, capsys):
    out = tmp_path / "overhead.json"
    argv = ["bench", "throughput", "--inspector", "--repeats", "1", "--dataset", "random", "--num-prompts", "4"]
    argv += ["--input-len", "24", "--output-len", "4", "--model", "dummy:tiny", "--device", "cpu"]
    argv += ["--num-kv-blocks", "64", "--max-model-len", "128", "--out", str(out)]
    assert main(argv) == 0
    assert "ratio on/off" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert len(res["runs_off"]) == len(res["runs_on"]) == 1 and res["num_finished"] == 4
    assert res["ratio_on_off"] == pytest.approx(res["runs_on"][0] / res["runs_off"][0])
    assert res["recorder_us_per_step"] > 0 and res["sse_encode_us_per_step"] > 0
    assert res["num_steps_per_run"] >= 4 and res["machine"]["cores"] >= 1


def test_inspect_command_refuses_a_missing_trace(tmp_path, capsys):
    assert main(["inspect", "--trace", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err
