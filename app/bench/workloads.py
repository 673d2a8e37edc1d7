"""Prefix-cache workloads, shared by `sluice bench prefix` (the real engine) and `sluice cache-sim` (the
scheduler and KV manager without a model), so both replay exactly the same requests.

A workload is a list of requests in token ids with forced output lengths (run with ``ignore_eos``), each
with an arrival time and, for multi-turn conversations, the request that must finish before it starts
(``after``: the previous turn). Three sources:

- `shared_prefix`: groups of prompts that share a system prompt; `shared_prefix_optimum` is its best
  possible hit rate, computed from the shape alone.
- `multi_turn`: ShareGPT conversations replayed turn by turn; each turn's prompt holds the whole history
  (the dataset's own replies), so a turn can hit everything its previous turn's prompt left in the cache.
- `load_trace`: a JSONL trace, one request per line (`TRACE_FORMAT`), written by hand or recorded by
  `sluice serve --record-trace`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FIRST_TOKEN_ID = 1000  # random prompts avoid the low ids, where tokenizers keep their special tokens


@dataclass(slots=True)
class WorkloadRequest:
    prompt_token_ids: list[int]
    output_len: int
    arrival_time: float = 0.0  # seconds after the start
    after: int | None = None  # index of the request that must finish first (the previous turn)
    cache_salt: str | None = None
    # The reply a real deployment recorded, when the source has one (traces, ShareGPT); only
    # `sluice cache-sim --recorded-replies` uses it, as the tokens its fake model "generates".
    reply_token_ids: list[int] | None = None


@dataclass(slots=True)
class Workload:
    name: str
    requests: list[WorkloadRequest]
    shape: dict[str, Any] = field(default_factory=dict)  # the parameters that built it

    def summary(self) -> dict[str, Any]:
        n = len(self.requests)
        p = sum(len(r.prompt_token_ids) for r in self.requests)
        o = sum(r.output_len for r in self.requests)
        return {
            "name": self.name,
            **self.shape,
            "num_requests": n,
            "prompt_tokens": p,
            "output_tokens": o,
            "mean_prompt_len": p / n if n else 0.0,
            "mean_output_len": o / n if n else 0.0,
        }

    def max_blocks_touched(self, block_size: int) -> int:
        """Blocks needed to hold every request's KV at once: a pool this big never evicts."""
        return sum(-(-(len(r.prompt_token_ids) + r.output_len) // block_size) for r in self.requests)


# ------------------------------------------------------------------------------------------ shared prefix


def shared_prefix(
    groups: int = 64,
    prompts_per_group: int = 16,
    system_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    vocab_size: int = 49152,
    seed: int = 0,
    order: str = "shuffled",
) -> Workload:
    """``groups x prompts_per_group`` prompts of random token ids: each group's prompts start with the
    same ``system_len``-token system prompt and end in their own ``question_len``-token question.

    Every system prompt and every question starts with a token no other one starts with, so two prompts
    share exactly their group's system prompt and nothing else (the optimum is then exact). ``order``:
    ``shuffled`` (seeded), ``grouped`` (group by group) or ``interleaved`` (one prompt of each group in
    turn, the hardest order for an LRU cache)."""
    if groups < 1 or prompts_per_group < 1:
        raise ValueError("groups and prompts_per_group must be >= 1")
    if system_len < 0 or question_len < 1 or output_len < 1:
        raise ValueError("system_len must be >= 0, question_len and output_len >= 1")
    if order not in ("shuffled", "grouped", "interleaved"):
        raise ValueError(f"order must be shuffled, grouped or interleaved, got {order!r}")
    if vocab_size - FIRST_TOKEN_ID < groups * (prompts_per_group + 1):
        raise ValueError(f"vocab_size {vocab_size} is too small for {groups} x {prompts_per_group} distinct prompts")
    rng = random.Random(seed)
    firsts = rng.sample(range(FIRST_TOKEN_ID, vocab_size), groups * (prompts_per_group + 1))

    def tokens(first: int, n: int) -> list[int]:
        return [first] + [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n - 1)] if n else []

    by_group: list[list[WorkloadRequest]] = []
    for g in range(groups):
        system = tokens(firsts[g], system_len)
        by_group.append(
            [
                WorkloadRequest(system + tokens(firsts[groups + g * prompts_per_group + q], question_len), output_len)
                for q in range(prompts_per_group)
            ]
        )
    if order == "grouped":
        reqs = [r for grp in by_group for r in grp]
    elif order == "interleaved":
        reqs = [by_group[g][q] for q in range(prompts_per_group) for g in range(groups)]
    else:
        reqs = [r for grp in by_group for r in grp]
        rng.shuffle(reqs)
    shape = dict(
        groups=groups,
        prompts_per_group=prompts_per_group,
        system_len=system_len,
        question_len=question_len,
        output_len=output_len,
        seed=seed,
        order=order,
    )
    return Workload("shared-prefix", reqs, shape)


def shared_prefix_optimum(
    groups: int, prompts_per_group: int, system_len: int, question_len: int, block_size: int
) -> tuple[int, int]:
    """(hit tokens, queried tokens) at the best possible caching of `shared_prefix`: the first prompt of a
    group computes everything; each other one finds the system prompt's full blocks (a block that mixes
    system and question tokens is its own). The last-token rule never bites, as every question has at
    least one token after the system prompt."""
    prompt_len = system_len + question_len
    hit_per_prompt = min(system_len // block_size, (prompt_len - 1) // block_size) * block_size
    return groups * (prompts_per_group - 1) * hit_per_prompt, groups * prompts_per_group * prompt_len


# ------------------------------------------------------------------------------------------ multi-turn


def multi_turn(
    encode_chat: Callable[[list[dict]], list[int]],
    conversations: Sequence[Sequence[str]],
    max_turns: int = 8,
    max_prompt_len: int = 2048,
    max_output_len: int = 256,
    encode_text: Callable[[str], list[int]] | None = None,
) -> Workload:
    """Conversations replayed turn by turn: turn k's prompt is the chat template over the first k user
    turns and the k - 1 dataset replies between them; its output length is the token count of reply k
    (at most ``max_output_len``, at least 1), and it starts when turn k - 1 has finished. A
    conversation stops before a turn whose prompt would exceed ``max_prompt_len``. ``conversations``
    hold turn texts, user first (`sluice.app.bench.datasets.sharegpt_conversations`)."""
    encode_text = encode_text or (lambda text: encode_chat([{"role": "assistant", "content": text}]))
    reqs: list[WorkloadRequest] = []
    for turns in conversations:
        messages: list[dict] = []
        prev: int | None = None
        for k in range(0, min(len(turns), 2 * max_turns), 2):
            messages.append({"role": "user", "content": turns[k]})
            prompt = encode_chat(messages)
            if len(prompt) > max_prompt_len:
                break
            reply = turns[k + 1] if k + 1 < len(turns) else ""
            reply_ids = encode_text(reply)[:max_output_len] if reply else []
            reqs.append(WorkloadRequest(prompt, max(1, len(reply_ids)), after=prev, reply_token_ids=reply_ids))
            prev = len(reqs) - 1
            messages.append({"role": "assistant", "content": reply})
    shape = dict(
        conversations=len(conversations),
        max_turns=max_turns,
        max_prompt_len=max_prompt_len,
        max_output_len=max_output_len,
    )
    return Workload("multi-turn", reqs, shape)


def sharegpt_multi_turn(
    tokenizer,
    num_conversations: int,
    seed: int = 0,
    max_turns: int = 8,
    max_prompt_len: int = 2048,
    max_output_len: int = 256,
) -> Workload:
    """`multi_turn` over ShareGPT conversations with at least two turns, sampled with ``seed``, encoded
    with ``tokenizer``'s chat template."""
    from sluice.app.bench.datasets import sharegpt_conversations
    from sluice.core.frontend.tokenizer import apply_chat_template

    convs = sharegpt_conversations(min_turns=2)
    if num_conversations > len(convs):
        raise ValueError(f"ShareGPT has {len(convs)} conversations with >= 2 turns; asked {num_conversations}")
    picked = random.Random(seed).sample(range(len(convs)), num_conversations)
    w = multi_turn(
        lambda messages: apply_chat_template(tokenizer, messages),
        [convs[i] for i in picked],
        max_turns=max_turns,
        max_prompt_len=max_prompt_len,
        max_output_len=max_output_len,
        encode_text=lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
    )
    w.shape["seed"] = seed
    return w


# ------------------------------------------------------------------------------------------ traces


TRACE_FORMAT = """\
A trace is JSON lines, one request per line in arrival order, e.g.
  {"arrival_time": 0.5, "messages": [{"role": "user", "content": "Hi"}], "output_len": 64, "cache_salt": "tenant-a"}
- the prompt: "prompt_token_ids" (token ids), "messages" (chat messages, through the model's chat template) or
  "prompt" (text);
- "arrival_time": seconds after the start (default 0); "output_len" (or "max_tokens"): tokens to generate;
- optional: "cache_salt" (the tenant: different salts never share cache blocks); "after": the index of an earlier
  request that must finish first (a previous turn); "reply_token_ids" or "reply": the reply the deployment gave
  (replayed with --recorded-replies).
`sluice serve --record-trace FILE` writes this format: its request lines carry "type": "request" (with token ids),
beside "meta", "step" and "kv" lines for `sluice inspect`, which this reader skips."""


def load_trace(path: str | Path, tokenizer=None, default_output_len: int = 128) -> Workload:
    """A JSONL trace in `TRACE_FORMAT`: the requests, in file order. ``messages`` and ``prompt`` need
    ``tokenizer``; ``output_len`` defaults to ``default_output_len``. Bad lines raise ValueError naming the line
    and field."""
    reqs: list[WorkloadRequest] = []
    with open(path, encoding="utf-8") as fh:
        lines = [(i + 1, line) for i, line in enumerate(fh) if line.strip()]
    n = 0
    for lineno, line in lines:
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from e
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: each line must be a JSON object")
        kind = obj.pop("type", "request")
        if kind in ("meta", "step", "kv"):  # a recorded trace's lines for the inspector
            continue
        if kind != "request":
            raise ValueError(f"{where}: unknown line type {kind!r} (request, meta, step or kv)")
        prompt = _trace_prompt(obj, tokenizer, where)
        out_len = obj.get("output_len", obj.get("max_tokens", default_output_len))
        if not isinstance(out_len, int) or out_len < 1:
            raise ValueError(f"{where}: output_len must be an integer >= 1, got {out_len!r}")
        arrival = obj.get("arrival_time", 0.0)
        if not isinstance(arrival, (int, float)) or arrival < 0:
            raise ValueError(f"{where}: arrival_time must be a number >= 0, got {arrival!r}")
        after = obj.get("after")
        if after is not None and (not isinstance(after, int) or not 0 <= after < n):
            raise ValueError(f"{where}: after must be the index of an earlier line (0..{n - 1}), got {after!r}")
        salt = obj.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"{where}: cache_salt must be a string")
        reply = obj.get("reply_token_ids")
        if reply is None and isinstance(obj.get("reply"), str) and tokenizer is not None:
            reply = list(tokenizer.encode(obj["reply"], add_special_tokens=False))
        reqs.append(WorkloadRequest(prompt, out_len, float(arrival), after, salt, reply))
        n += 1
    if not reqs:
        raise ValueError(f"{path}: no requests in it (see `sluice cache-sim --help` for the trace format)")
    return Workload("trace", reqs, {"trace": str(path)})


def _trace_prompt(obj: dict, tokenizer, where: str) -> list[int]:
    if "prompt_token_ids" in obj:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of token ids")
        return ids
    if "messages" in obj or "prompt" in obj:
        if tokenizer is None:
            raise ValueError(f"{where}: messages and prompt need a tokenizer (give --model)")
        if "messages" in obj:
            from sluice.core.frontend.tokenizer import apply_chat_template

            return apply_chat_template(tokenizer, obj["messages"])
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ValueError(f"{where}: prompt must be a non-empty string")
        return list(tokenizer.encode(obj["prompt"], add_special_tokens=True))
    raise ValueError(f"{where}: needs prompt_token_ids, messages or prompt")


def write_trace(path: str | Path, workload: Workload) -> None:
    """Write ``workload`` as a JSONL trace that `load_trace` reads back unchanged."""
    with open(path, "w", encoding="utf-8") as fh:
        for r in workload.requests:
            obj: dict[str, Any] = {
                "arrival_time": r.arrival_time,
                "prompt_token_ids": r.prompt_token_ids,
                "output_len": r.output_len,
            }
            if r.after is not None:
                obj["after"] = r.after
            if r.cache_salt is not None:
                obj["cache_salt"] = r.cache_salt
            if r.reply_token_ids is not None:
                obj["reply_token_ids"] = r.reply_token_ids
            fh.write(json.dumps(obj) + "\n")


# ------------------------------------------------------------------------------------------ command line


def add_workload_args(p) -> None:
    """The workload flags of `sluice bench prefix` and `sluice cache-sim` (an argparse parser)."""
    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        choices=["shared-prefix", "multi-turn"],
        default="shared-prefix",
        help="groups of prompts sharing a system prompt, or ShareGPT conversations replayed turn by turn",
    )
    g.add_argument(
        "--trace",
        default=None,
        metavar="FILE.jsonl",
        help="replay this trace instead (`sluice serve --record-trace` writes one; the format is below)",
    )
    g.add_argument("--groups", type=int, default=64, help="shared-prefix: groups of prompts")
    g.add_argument("--prompts-per-group", type=int, default=16, help="shared-prefix: prompts per group")
    g.add_argument("--system-len", type=int, default=2048, help="shared-prefix: system prompt tokens")
    g.add_argument("--question-len", type=int, default=128, help="shared-prefix: question tokens")
    g.add_argument(
        "--order",
        choices=["shuffled", "grouped", "interleaved"],
        default="shuffled",
        help="shared-prefix: arrival order: seeded shuffle, group by group, or one prompt of each group in turn",
    )
    g.add_argument(
        "--output-len", type=int, default=256, help="forced output tokens (multi-turn: at most; trace: default)"
    )
    g.add_argument("--conversations", type=int, default=64, help="multi-turn: ShareGPT conversations")
    g.add_argument("--max-turns", type=int, default=8, help="multi-turn: user turns per conversation")
    g.add_argument("--max-prompt-len", type=int, default=2048, help="multi-turn: stop a conversation beyond this")
    g.add_argument("--workload-seed", type=int, default=0, help="seed of the workload's prompts and order")


def build_workload(ns, load_tokenizer: Callable[[], Any], vocab_size: int) -> Workload:
    """The workload the flags of `add_workload_args` describe; the tokenizer is loaded only if needed."""
    if ns.trace:
        return load_trace(ns.trace, _LazyTokenizer(load_tokenizer), default_output_len=ns.output_len)
    if ns.workload == "multi-turn":
        return sharegpt_multi_turn(
            load_tokenizer(),
            ns.conversations,
            seed=ns.workload_seed,
            max_turns=ns.max_turns,
            max_prompt_len=ns.max_prompt_len,
            max_output_len=ns.output_len,
        )
    return shared_prefix(
        ns.groups,
        ns.prompts_per_group,
        ns.system_len,
        ns.question_len,
        ns.output_len,
        vocab_size=vocab_size,
        seed=ns.workload_seed,
        order=ns.order,
    )


class _LazyTokenizer:
    """Loads the tokenizer on first use, so a trace of token ids needs none."""

    def __init__(self, load: Callable[[], Any]) -> None:
        self._load = load
        self._tok = None

    def __getattr__(self, name: str):
        if self._tok is None:
            self._tok = self._load()
        return getattr(self._tok, name)
