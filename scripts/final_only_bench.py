"""What `final_only` saves on the host: N greedy requests submitted at once to one engine, consumed as streams
(one output per token) and as final outputs only (`AsyncEngine.generate(..., final_only=True)`, what
`LLM.generate` uses), alternating, in one run. Prints seconds and output tokens/s per side and writes JSON.

    python scripts/final_only_bench.py --model dummy:tiny --device cpu --num-requests 512 --max-tokens 128

With a small model the step is cheap and the per-token wake-ups of the request actors are a large part of it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    import anyio
    from sluice.app.bench.common import drive_engine
    from sluice.app.bench.datasets import sample_random
    from sluice.app.bench.results import command_line, machine_line, write_result
    from sluice.core import AsyncEngine, EngineArgs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy:tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    args = EngineArgs(
        model=ns.model,
        device=ns.device,
        max_num_seqs=ns.num_requests,
        max_waiting_requests=ns.num_requests,
        max_num_batched_tokens=8192,
        max_model_len=ns.input_len + ns.max_tokens,
        **({"num_kv_blocks": 20000} if ns.device == "cpu" else {}),
    )
    sides: dict[str, list[dict]] = {"streamed": [], "final_only": []}

    async def go() -> None:
        async with AsyncEngine(args) as engine:
            vocab = engine.source.config.vocab_size
            requests = sample_random(ns.num_requests, ns.input_len, ns.max_tokens, vocab, seed=0)
            await drive_engine(engine, requests[:32], tag="warmup", final_only=True)
            for r in range(ns.rounds):
                for name in sides:
                    run = await drive_engine(engine, requests, tag=f"{name}{r}", final_only=name == "final_only")
                    n = sum(run.output_lens)
                    sides[name].append({"seconds": round(run.elapsed_s, 3), "output_tokens": n,
                                        "tokens_per_s": round(n / run.elapsed_s, 1)})  # fmt: skip

    anyio.run(go)
    speedup = sum(x["tokens_per_s"] for x in sides["final_only"]) / sum(x["tokens_per_s"] for x in sides["streamed"])
    print(f"final_only bench: {ns.model} on {ns.device}, {ns.num_requests} requests, {ns.input_len} in / "
          f"{ns.max_tokens} out")  # fmt: skip
    print(machine_line())
    for name, runs in sides.items():
        print(f"{name:11s} " + "  ".join(f"{x['seconds']:.2f}s {x['tokens_per_s']:,.0f} tok/s" for x in runs))
    print(f"final_only / streamed: {speedup:.2f}x")
    if ns.out:
        dataset = {"name": "random", "num_requests": ns.num_requests, "input_len": ns.input_len, "seed": 0}
        write_result(ns.out, command_line(), ns.model, dataset, {"sides": sides, "speedup": round(speedup, 3)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
