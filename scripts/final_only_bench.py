"""What `final_only` saves on the host: N greedy requests submitted at once to one engine, consumed as streams
(one output per token) and as final outputs only (`AsyncEngine.generate(..., final_only=True)`, what
`LLM.generate` uses), alternating, in one run. Prints seconds and output tokens/s per side and writes JSON.

    python scripts/final_only_bench.py --model dummy:tiny --device cpu --num-requests 512 --max-tokens 128

With a small model the step is cheap and the per-token wake-ups of the request actors are a large part of it.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def _run(engine, prompts: list[list[int]], max_tokens: int, final_only: bool, tag: str) -> tuple[float, int]:
    import anyio

    from core import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = [0] * len(prompts)

    async def one(i: int) -> None:
        async for out in engine.generate(prompts[i], params, request_id=f"{tag}-{i}", final_only=final_only):
            if out.finished:
                tokens[i] = len(out.token_ids)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return time.perf_counter() - t0, sum(tokens)


def main(argv: list[str] | None = None) -> int:
    import anyio

    from app.bench.results import command_line, machine_line, write_result
    from core import AsyncEngine, EngineArgs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy:tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 1000) for _ in range(rng.randrange(20, 120))] for _ in range(ns.num_requests)]
    args = EngineArgs(
        model=ns.model,
        device=ns.device,
        max_num_seqs=ns.num_requests,
        max_waiting_requests=ns.num_requests,
        max_num_batched_tokens=8192,
        max_model_len=512,
        **({"num_kv_blocks": 20000} if ns.device == "cpu" else {}),
    )
    sides: dict[str, list[dict]] = {"streamed": [], "final_only": []}

    async def go() -> None:
        async with AsyncEngine(args) as engine:
            await _run(engine, prompts[:32], 8, True, "warmup")
            for r in range(ns.rounds):
                for name in ("streamed", "final_only"):
                    s, n = await _run(engine, prompts, ns.max_tokens, name == "final_only", f"{name}{r}")
                    sides[name].append({"seconds": round(s, 3), "output_tokens": n, "tokens_per_s": round(n / s, 1)})

    anyio.run(go)
    speedup = sum(x["tokens_per_s"] for x in sides["final_only"]) / sum(x["tokens_per_s"] for x in sides["streamed"])
    print(f"final_only bench: {ns.model} on {ns.device}, {ns.num_requests} requests x {ns.max_tokens} tokens")
    print(machine_line())
    for name, runs in sides.items():
        print(f"{name:11s} " + "  ".join(f"{x['seconds']:.2f}s {x['tokens_per_s']:,.0f} tok/s" for x in runs))
    print(f"final_only / streamed: {speedup:.2f}x")
    if ns.out:
        dataset = {"prompts": "random ids, 20-119 long, seed 0", "num_requests": ns.num_requests}
        write_result(ns.out, command_line(), ns.model, dataset, {"sides": sides, "speedup": round(speedup, 3)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
