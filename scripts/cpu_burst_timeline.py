"""Where a burst's first step waits, on the CPU machine: `dummy:tiny` with its forward stubbed (as `sluice bench
host` does), N requests submitted by the offline benchmark's own `drive_engine`, and the times
from the submission of: the first caller's first turn, the last caller's, the scheduler's first admission, each
`schedule`, the executor's hand-off to its worker thread, the worker's launch and the first forward.

    PYTHONPATH=$(scripts/namespace_path.sh) python scripts/cpu_burst_timeline.py [--num-seqs 200] [--rounds 3]

`SLUICE_ADMITTING` (the gate, `core/frontend/engine.py`) applies as in the engine. Each await on an anyio stream or
thread hand-off yields to the event loop first, so during a burst every hop waits for the callers queued before it.
"""

from __future__ import annotations

import argparse
import functools
import time

import anyio
import anyio.to_thread
import torch
from sluice.app.bench.common import SUBMIT_CHUNK, drive_engine
from sluice.app.bench.datasets import BenchRequest
from sluice.core import AsyncEngine, EngineArgs, executor, model_runner, scheduler, scheduler_actor
from sluice.core.models import llama

EVENTS: list[tuple[str, float]] = []  # (what, perf_counter) of the burst; the first of each kind is kept


def _first(what: str) -> None:
    if what not in {w for w, _ in EVENTS}:
        EVENTS.append((what, time.perf_counter()))


def _marked(cls, name: str, what: str) -> None:
    orig = getattr(cls, name)

    @functools.wraps(orig)
    def wrapper(self, *args, **kwargs):
        _first(what)
        return orig(self, *args, **kwargs)

    setattr(cls, name, wrapper)


def _install(stub_s: float) -> None:
    def forward(self, input_ids, positions, ctx, aux_layers=()):
        _first("first forward")
        time.sleep(stub_s)
        hidden = torch.zeros(input_ids.shape[0], self.config.hidden_size, dtype=self.model.embed_tokens.weight.dtype)
        return (hidden, hidden) if aux_layers else hidden

    def compute_logits(self, hidden):
        logits = torch.zeros(hidden.shape[0], 64)
        logits[:, -1] = 1.0
        return logits

    llama.LlamaForCausalLM.forward = forward
    llama.LlamaForCausalLM.compute_logits = compute_logits
    _marked(scheduler_actor.SchedulerActor, "_add", "first admission")
    _marked(scheduler.Scheduler, "schedule", "first schedule")
    _marked(executor.ExecutorActor, "_launch_then_collect", "worker starts the launch")
    _marked(model_runner.ModelRunner, "launch", "launch")
    to_thread = anyio.to_thread.run_sync

    async def run_sync(fn, *args, **kwargs):
        if getattr(fn, "__name__", "") == "_launch_then_collect":
            _first("executor hands off")
        return await to_thread(fn, *args, **kwargs)

    executor.anyio.to_thread.run_sync = run_sync


def _requests(n: int, input_len: int) -> list[BenchRequest]:
    return [BenchRequest([1 + (i * 7919 + j * 104729) % 1000 for j in range(input_len)], 4) for i in range(n)]


def _mark_callers(engine) -> None:
    """Each caller's first turn: the benchmark's callers (`drive_engine`) call `generate` first thing."""
    generate = engine.generate

    def marked(*args, **kwargs):
        EVENTS.append(("caller turn", time.perf_counter()))
        return generate(*args, **kwargs)

    engine.generate = marked


async def _round(ns) -> dict[str, float]:
    n = ns.num_seqs
    args = EngineArgs(
        model="dummy:tiny", device="cpu", max_num_seqs=n, max_num_batched_tokens=8192, max_waiting_requests=2 * n,
        num_kv_blocks=n * (-(-(ns.input_len + 4) // 16) + 1) + 64, max_model_len=ns.input_len + 32,
        enable_prefix_caching=False,
    )  # fmt: skip
    async with AsyncEngine(args) as engine:
        await drive_engine(engine, _requests(8, ns.input_len), tag="warmup", final_only=True)
        requests = _requests(n, ns.input_len)  # before the clock, as a requests file's are
        _mark_callers(engine)
        EVENTS.clear()
        t0 = time.perf_counter()
        await drive_engine(engine, requests, tag="run", final_only=True, submit_chunk=ns.submit_chunk)
    turns = [t for w, t in EVENTS if w == "caller turn"]
    out = {"first caller's turn": turns[0], "last caller's turn": turns[-1]}
    out.update((w, t) for w, t in EVENTS if w != "caller turn")
    return {w: 1e3 * (t - t0) for w, t in sorted(out.items(), key=lambda kv: kv[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-seqs", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=243)
    ap.add_argument("--stub-ms", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--submit-chunk", type=int, default=SUBMIT_CHUNK, help="callers spawned per turn of the event loop (0: all)"
    )
    ns = ap.parse_args()
    torch.set_num_threads(1)
    _install(ns.stub_ms / 1000)
    for r in range(ns.rounds):
        times = anyio.run(_round, ns)
        print(f"round {r + 1}, {ns.num_seqs} requests (ms from their submission):")
        for what, ms in times.items():
            print(f"  {ms:7.2f}  {what}")


if __name__ == "__main__":
    main()
