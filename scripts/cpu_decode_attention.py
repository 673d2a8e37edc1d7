"""The compiled CPU decode step's attention: the kernel (`core/models/cpu_attention.cpp`, through the step's backend
`kv/attention/cpu_decode.py`) against the torch-ops
backend it replaced (`kv/attention/torch_decode.py`) as the compiler builds it (inductor's C++ code, as
`core/worker/cpu_compiled.py` compiles the step; here with the guards of its few inputs).

    python scripts/cpu_decode_attention.py --threads 1 2 --out decode_attention.json

The default model's heads (9 query heads over 3 KV heads of 64, a bf16 cache in blocks of 16) at one row and at
4, with contexts of 128 to 1024 keys: 30 layers' calls in turn, each over a cache of its own (as a step reads 30
layers' caches); the least time of five passes after a first, per layer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from scripts.cpu_packed_rows import best_ms  # noqa: E402

LAYERS, HQ, HK, D, BLOCK = 30, 9, 3, 64, 16


def measure(rows: int, ctx: int, compiled) -> dict:
    """Both at ``rows`` rows of ``ctx`` keys: 30 layers' calls, each over its own cache; equal first."""
    from sluice.kv.attention.base import AttentionMetadata
    from sluice.kv.attention.cpu_decode import CpuKernelDecodeAttentionBackend

    width = -(-ctx // BLOCK)
    caches = [torch.randn(2, rows * width, BLOCK, HK, D, dtype=torch.bfloat16) for _ in range(LAYERS)]
    tables = torch.arange(rows * width, dtype=torch.int32).view(rows, width)
    lens = torch.full((rows,), ctx, dtype=torch.int32)
    q = torch.randn(rows, HQ, D, dtype=torch.bfloat16)
    meta, backend = AttentionMetadata(None, lens, lens, tables, 1, 0, [], []), CpuKernelDecodeAttentionBackend()
    torch.testing.assert_close(backend.forward(q, caches[0], meta, D**-0.5), compiled(q, caches[0], tables, lens))
    kernel = best_ms(lambda: [backend.forward(q, c, meta, D**-0.5) for c in caches])
    inductor = best_ms(lambda: [compiled(q, c, tables, lens) for c in caches])
    return dict(
        kernel_us_per_layer=1e3 * kernel / LAYERS,
        torch_ops_compiled_us_per_layer=1e3 * inductor / LAYERS,
        speedup=inductor / kernel,
    )


def main() -> int:
    from sluice.core.models import cpu_vnni
    from sluice.kv.attention.base import AttentionMetadata
    from sluice.kv.attention.torch_decode import TorchDecodeAttentionBackend

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    p.add_argument("--out", default=None)
    ns = p.parse_args()
    if not cpu_vnni.load():
        print("the kernel is not built on this machine (cpu_vnni.load)")
        return 1
    torch.manual_seed(0)
    backend = TorchDecodeAttentionBackend()

    def torch_ops(q, kv, tables, lens):
        return backend.forward(q, kv, AttentionMetadata(None, lens, lens, tables, 1, 0, [], []), D**-0.5)

    compiled = torch.compile(torch_ops, fullgraph=True, dynamic=True)  # its guards: a few tensors, microseconds
    rows_out = []
    for threads in ns.threads:
        torch.set_num_threads(threads)
        for rows in ns.rows:
            for ctx in ns.contexts:
                row = dict(threads=threads, rows=rows, context=ctx, **measure(rows, ctx, compiled))
                print(
                    f"threads {threads} rows {rows} context {ctx:5d}: kernel {row['kernel_us_per_layer']:7.1f} "
                    f"us/layer, torch ops {row['torch_ops_compiled_us_per_layer']:7.1f} ({row['speedup']:.1f}x)"
                )
                rows_out.append(row)
    from sluice.app.bench.results import machine_line

    print(machine_line())
    if ns.out:
        Path(ns.out).write_text(json.dumps({"machine": machine_line(), "rows": rows_out}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
