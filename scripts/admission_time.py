"""How long a burst of requests takes to reach the device: from submitting N requests at once (as `sluice bench
throughput` does) to the first forward that carries their prompts, with the model's forward stubbed (a constant
sleep, as `sluice bench host` does), so it runs on the CPU machine. The engine's heap frozen after start-up (the
default) and not (``gc_freeze=False``), alternating in one run, each engine in a process of its own.

    python scripts/admission_time.py .stage/sharegpt1000.json --num-prompts 1000 --rounds 3

On the H200 the same interval is the device's idle time before a throughput run's first step (the step trace's
idle before it, `scripts/step_mix.py --trace`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import anyio
import torch
from sluice.core import AsyncEngine, EngineArgs, SamplingParams
from sluice.core.models import llama

FIRST: list[float] = []


def _forward(self, input_ids, positions, ctx, aux_layers=()):
    if not FIRST and input_ids.shape[0] > 256:  # the burst's first step (the warm-up's are a few tokens)
        FIRST.append(time.perf_counter())
    time.sleep(0.005)  # the device's time: the host is free meanwhile
    hidden = torch.zeros(input_ids.shape[0], self.config.hidden_size, dtype=self.model.embed_tokens.weight.dtype)
    return (hidden, hidden) if aux_layers else hidden


def _compute_logits(self, hidden):
    logits = torch.zeros(hidden.shape[0], 64)
    logits[:, -1] = 1.0
    return logits


async def _burst(engine: AsyncEngine, prompts: list[list[int]], tag: str, max_tokens: int) -> None:
    async def one(i: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async for _ in engine.generate(prompts[i], params, request_id=f"{tag}{i}", final_only=True):
            pass

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)


async def measure(prompts: list[list[int]], gc_freeze: bool) -> float:
    """Milliseconds from the burst's submission to its first forward."""
    args = EngineArgs(
        model="dummy:tiny", device="cpu", max_num_seqs=512, max_num_batched_tokens=8192,
        max_waiting_requests=2 * len(prompts), num_kv_blocks=60000, max_model_len=4096, gc_freeze=gc_freeze,
    )  # fmt: skip
    async with AsyncEngine(args) as engine:
        await _burst(engine, prompts[:4], "warmup", 4)
        FIRST.clear()
        t0 = time.perf_counter()
        await _burst(engine, prompts, "run", 2)
        return 1e3 * (FIRST[0] - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("requests_file", help="a saved requests file (`sluice bench throughput --save-requests`)")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", choices=("gc_freeze", "no_gc_freeze"), help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:  # one engine in a fresh process: no other engine's objects for the collector to walk
        llama.LlamaForCausalLM.forward = _forward
        llama.LlamaForCausalLM.compute_logits = _compute_logits
        prompts = [r["prompt_token_ids"] for r in json.load(open(ns.requests_file))["requests"][: ns.num_prompts]]
        torch.set_num_threads(1)
        print(anyio.run(measure, prompts, ns.child == "gc_freeze"))
        return
    ms: dict[str, list[float]] = {"gc_freeze": [], "no_gc_freeze": []}
    for _ in range(ns.rounds):
        for name in ms:
            cmd = [sys.executable, __file__, ns.requests_file, "--num-prompts", str(ns.num_prompts), "--child", name]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            ms[name].append(float(out.split()[-1]))
            print(f"{name:13s} {ns.num_prompts} requests: first forward after {ms[name][-1]:7.1f} ms", flush=True)
    for name, v in ms.items():
        print(f"{name:13s} median {statistics.median(v):7.1f} ms over {len(v)} rounds")


if __name__ == "__main__":
    main()
