"""The CPU's int4 projections at a few rows: each int4 kernel (torch's ``int4pack``, ``int4vnni`` where the CPU
has it) against a bf16 GEMM on the dense copy.

    python scripts/cpu_packed_rows.py --threads 1 2 --out packed_rows.json

The default model's four projection shapes (q/k/v 960 x 576, o 576 x 576, gate/up 3072 x 576, down 576 x 1536), 30
layers of each with their own random weights (rounded to int4 in groups of 32, `Int4PackedLinear.from_int4`), all
120 called in turn at 1 to 16 rows of x: what a decode step (1 row), a speculative verification (k + 1 rows) and a
batched decode spend in them. The least time of five passes after a first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (N, K)
LAYERS = 30


def best_ms(fn, passes: int = 5) -> float:
    """The least ms of ``passes`` calls of ``fn()`` after a first."""
    fn()
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def main() -> int:
    from sluice.core.models.cpu_linear import ROUNDED_GROUP_SIZE, Int4PackedLinear, cpu_isa
    from sluice.core.models.quant import quantize_int4

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 15])
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    torch.manual_seed(0)
    g = ROUNDED_GROUP_SIZE
    dense = {name: [(torch.randn(n, k) * 0.02).bfloat16() for _ in range(LAYERS)] for name, (n, k) in SHAPES.items()}
    kernels = ["int4pack"] + (["int4vnni"] if cpu_isa() == "AVX512_VNNI" else [])
    layers = {
        kernel: {
            name: [Int4PackedLinear.from_int4(*quantize_int4(w, g), None, g, dense=w, kernel=kernel) for w in ws]
            for name, ws in dense.items()
        }
        for kernel in kernels
    }
    rows = []
    for threads in ns.threads:
        torch.set_num_threads(threads)
        for m in ns.rows:
            xs = {name: torch.randn(m, k).bfloat16() for name, (_, k) in SHAPES.items()}

            def few_rows(kernel: str, xs=xs) -> None:
                for name, ls in layers[kernel].items():
                    for layer in ls:
                        layer.rows(xs[name])

            def gemm(xs=xs) -> None:
                for name, ws in dense.items():
                    for w in ws:
                        torch.nn.functional.linear(xs[name], w)

            row = dict(threads=threads, rows=m, bf16_dense_ms=best_ms(gemm))
            row |= {f"{kernel}_ms": best_ms(lambda k=kernel: few_rows(k)) for kernel in kernels}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if ns.out:
        from sluice.app.bench.results import machine_info, versions

        result = dict(rows=rows, command=" ".join(sys.argv), machine=machine_info(), versions=versions(),
                      date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))  # fmt: skip
        Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
