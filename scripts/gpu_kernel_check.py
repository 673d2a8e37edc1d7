"""Check the Triton paged-attention kernels against the torch reference at real shapes, and time them.

    python scripts/gpu_kernel_check.py --out gpu_kernel_check.json       # on the GPU (H200)
    python scripts/gpu_kernel_check.py --tiny --out /tmp/tiny.json        # CPU smoke, Triton interpreter

Per case: the Triton output against the exact answer (the torch reference run in fp32 on the same
16-bit inputs, one sequence at a time), as ``max|triton - exact| / max|exact|``; the 16-bit torch
reference's own error for comparison; PASS/FAIL under the dtype's tolerance; median ms of the Triton
backend and of the torch reference (``triton.testing.do_bench``; CUDA-graph replay for the graph case).
Results are rewritten to ``--out`` after every case. Exit status 1 if any case FAILs or errors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}

MODELS = {  # name: (num_heads, num_kv_heads, head_dim)
    "llama3-8b": (32, 8, 128),
    "smollm2": (9, 3, 64),
    "tiny-gqa4": (8, 2, 64),
    "tiny-mha": (2, 2, 32),
}


@dataclass
class Case:
    name: str
    kind: str  # decode | prefill | chunked | mixed | write | graph
    model: str
    seq_lens: list[int] = field(default_factory=list)
    q_lens: list[int] = field(default_factory=list)
    dtype: str = "bfloat16"
    block_size: int = 16


def _rand_lens(n: int, lo: int, hi: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    lens = [rng.randint(lo, hi) for _ in range(n)]
    lens[0] = hi  # the bound is always reached
    return lens


def real_cases() -> list[Case]:
    cases: list[Case] = []
    for model in ("llama3-8b", "smollm2"):
        for batch, ctx, rand in [(1, 1024, False), (1, 8192, False), (8, 8192, False), (32, 4096, True),
                                 (64, 8192, True), (128, 2048, True), (256, 8192, True)]:  # fmt: skip
            lens = _rand_lens(batch, 1, ctx, batch) if rand else [ctx] * batch
            tag = f"rand<={ctx}" if rand else f"{ctx}"
            cases.append(Case(f"{model} decode b{batch} ctx{tag}", "decode", model, lens, [1] * batch))
        cases.append(Case(f"{model} prefill 8x2048", "prefill", model, [2048] * 8, [2048] * 8))
        cases.append(Case(f"{model} chunked 4x(4096 cached+512)", "chunked", model, [4096 + 512] * 4, [512] * 4))
        cases.append(Case(f"{model} chunked 1x(7680 cached+512)", "chunked", model, [8192], [512]))
        dec = _rand_lens(126, 1, 4096, 7)
        cases.append(
            Case(f"{model} mixed 2x1024-chunk + 126 decode", "mixed", model, [2048, 1024] + dec,
                 [1024, 1024] + [1] * 126)
        )  # fmt: skip
        cases.append(Case(f"{model} write 256 decode tokens", "write", model, q_lens=[1] * 256))
        cases.append(Case(f"{model} write 16384 prefill tokens", "write", model, q_lens=[2048] * 8))
    cases.append(
        Case(
            "llama3-8b decode b64 ctx4096 block32",
            "decode",
            "llama3-8b",
            [4096] * 64,
            [1] * 64,
            block_size=32,
        )
    )
    cases.append(
        Case("llama3-8b prefill 2x1024 block32", "prefill", "llama3-8b", [1024] * 2, [1024] * 2, block_size=32)
    )
    for dtype in ("float16", "float32"):
        cases.append(Case(f"llama3-8b decode b16 ctx2048 {dtype}", "decode", "llama3-8b", [2048] * 16, [1] * 16, dtype))
        cases.append(Case(f"llama3-8b prefill 2x1024 {dtype}", "prefill", "llama3-8b", [1024] * 2, [1024] * 2, dtype))
    for model in ("llama3-8b", "smollm2"):
        lens = _rand_lens(32, 1, 8192, 3)
        cases.append(Case(f"{model} cuda-graph decode b32 (captured at 8192)", "graph", model, lens, [1] * 32))
    return cases


def tiny_cases() -> list[Case]:
    cases = []
    for model in ("tiny-gqa4", "tiny-mha"):
        cases += [
            Case(f"{model} decode b3", "decode", model, [1, 17, 300], [1] * 3),
            Case(f"{model} decode b2 ctx1100 (splits)", "decode", model, [1100, 513], [1] * 2),
            Case(f"{model} prefill 2x40", "prefill", model, [40, 33], [40, 33]),
            Case(f"{model} chunked", "chunked", model, [90, 50], [20, 16]),
            Case(f"{model} mixed", "mixed", model, [70, 17, 1], [30, 1, 1]),
            Case(f"{model} write", "write", model, q_lens=[5, 1, 9]),
        ]
    cases.append(Case("tiny-gqa4 decode fp32", "decode", "tiny-gqa4", [15, 16, 65], [1] * 3, "float32"))
    cases.append(Case("tiny-gqa4 prefill fp16 block32", "prefill", "tiny-gqa4", [40], [40], "float16", 32))
    cases.append(Case("tiny-gqa4 cuda-graph decode", "graph", "tiny-gqa4", [5, 40, 1030], [1] * 3))
    return cases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON results path (rewritten after every case)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU: runs under the Triton interpreter)")
    ap.add_argument("--only", default="", help="run only cases whose name contains this substring")
    ap.add_argument("--no-bench", action="store_true", help="skip timing")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        if not args.tiny:
            print("no CUDA device: the real shapes need a GPU (use --tiny for a CPU smoke)", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    import triton
    from sluice.kv.attention.base import AttentionMetadata
    from sluice.kv.attention.torch_ref import TorchAttentionBackend
    from sluice.kv.attention.triton_backend import TritonAttentionBackend

    device = torch.device("cuda" if on_gpu else "cpu")
    ref = TorchAttentionBackend()
    tri = TritonAttentionBackend()

    def build(case: Case, max_seq_len_bound: int | None = None):
        num_heads, num_kv_heads, head_dim = MODELS[case.model]
        dtype = getattr(torch, case.dtype)
        bs = case.block_size
        g = torch.Generator(device=device).manual_seed(args.seed)
        blocks = [-(-s // bs) for s in case.seq_lens]
        num_blocks = sum(blocks) + 8
        perm = torch.randperm(num_blocks - 1, device=device, generator=g) + 1  # shuffled; block 0 = padding
        table = torch.zeros(len(blocks), max(blocks) + 1, dtype=torch.int32, device=device)
        starts = [0]
        for n in blocks:
            starts.append(starts[-1] + n)
        for i, n in enumerate(blocks):
            table[i, :n] = perm[starts[i] : starts[i] + n].to(torch.int32)
        cache = torch.randn(2, num_blocks, bs, num_kv_heads, head_dim, device=device, generator=g, dtype=dtype)
        num_tokens = sum(case.q_lens)
        query = torch.randn(num_tokens, num_heads, head_dim, device=device, generator=g, dtype=dtype)
        qsl = [0]
        for q in case.q_lens:
            qsl.append(qsl[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.int64, device=device),  # not used by forward
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=device),
            block_tables=table,
            max_query_len=max(case.q_lens),
            max_seq_len=max_seq_len_bound or max(case.seq_lens),
            query_start_loc_host=qsl,
            seq_lens_host=list(case.seq_lens),
        )
        return query, cache, meta, 1.0 / math.sqrt(head_dim)

    def exact(query, cache, meta, scale):
        """fp32 reference, one sequence at a time (bounded memory; K/V upcast per sequence)."""
        out = torch.empty(query.shape, dtype=torch.float32, device=device)
        qsl = meta.query_start_loc_host
        for i in range(meta.num_seqs):
            s, e = qsl[i], qsl[i + 1]
            out[s:e] = ref._one_seq(query[s:e].float(), cache, meta.block_tables[i], meta.seq_lens_host[i], scale)
        return out

    def rel(a, b) -> float:
        return ((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    def bench(fn) -> float | None:
        if args.no_bench:
            return None
        if on_gpu:
            return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3  # interpreter: one run, indicative only

    def run_attention(case: Case, rec: dict) -> None:
        query, cache, meta, scale = build(case)
        nh, nkv, _ = MODELS[case.model]
        if meta.is_pure_decode:
            rec["num_splits"] = tri.decode_splits(meta.max_seq_len, meta.num_seqs, nkv, device)
        want = exact(query, cache, meta, scale)
        out = tri.forward(query, cache, meta, scale)
        rec["finite"] = bool(torch.isfinite(out).all().item())
        rec["rel_err"] = rel(out, want)
        try:
            rec["torch_ref_rel_err"] = rel(ref.forward(query, cache, meta, scale), want)
        except torch.OutOfMemoryError:
            rec["torch_ref_rel_err"] = None
            torch.cuda.empty_cache()
        rec["pass"] = rec["finite"] and rec["rel_err"] <= rec["tol"]
        rec["triton_ms"] = bench(lambda: tri.forward(query, cache, meta, scale))
        try:
            rec["torch_ms"] = bench(lambda: ref.forward(query, cache, meta, scale))
        except torch.OutOfMemoryError:
            rec["torch_ms"] = None
            torch.cuda.empty_cache()

    def run_graph(case: Case, rec: dict) -> None:
        """Capture decode once with every sequence at the bound (``max_seq_len`` = bound), then replay it
        on new contents: the case's own (shorter, varied) lengths, other block tables, other queries."""
        bound = max(case.seq_lens)
        full = Case(case.name, case.kind, case.model, [bound] * len(case.seq_lens), case.q_lens, case.dtype,
                    case.block_size)  # fmt: skip
        query, cache, meta, scale = build(full)
        q2, cache2, meta2, _ = build(case)
        meta2.max_seq_len = bound  # what the captured graph was planned with
        rec["num_splits"] = tri.decode_splits(bound, meta.num_seqs, MODELS[case.model][1], device)
        if not on_gpu:  # no graphs on the CPU: check only that planning for the bound stays exact
            out = tri.forward(q2, cache2, meta2, scale)
            rec["finite"] = bool(torch.isfinite(out).all().item())
            rec["rel_err"] = rel(out, exact(q2, cache2, meta2, scale))
            rec["pass"] = rec["finite"] and rec["rel_err"] <= rec["tol"]
            return
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                tri.forward(query, cache, meta, scale)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = tri.forward(query, cache, meta, scale)
        # the next step writes new contents into the same buffers
        cache[:, : cache2.shape[1]].copy_(cache2)
        query.copy_(q2)
        meta.seq_lens.copy_(meta2.seq_lens)
        meta.block_tables.zero_()
        meta.block_tables[:, : meta2.block_tables.shape[1]].copy_(meta2.block_tables)
        graph.replay()
        torch.cuda.synchronize()
        want = exact(q2, cache, meta2, scale)
        rec["finite"] = bool(torch.isfinite(static_out).all().item())
        rec["rel_err"] = rel(static_out, want)
        rec["pass"] = rec["finite"] and rec["rel_err"] <= rec["tol"]
        rec["triton_ms"] = bench(graph.replay)  # kernels only, no launch overhead
        rec["torch_ms"] = bench(lambda: ref.forward(q2, cache, meta2, scale))

    def run_write(case: Case, rec: dict) -> None:
        _, num_kv_heads, head_dim = MODELS[case.model]
        dtype = getattr(torch, case.dtype)
        bs = case.block_size
        num_tokens = sum(case.q_lens)
        g = torch.Generator(device=device).manual_seed(args.seed)
        num_blocks = -(-num_tokens // bs) * 2 + 1
        cache = torch.randn(2, num_blocks, bs, num_kv_heads, head_dim, device=device, generator=g, dtype=dtype)
        fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, device=device, generator=g, dtype=dtype)
        key, value = fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 2 * num_kv_heads :]  # strided views
        slots = torch.randperm(num_blocks * bs, device=device, generator=g)[:num_tokens]
        slots[:: max(1, num_tokens // 7)] = -1
        keep = slots >= 0
        expected = cache.clone()
        ref.write_kv(key[keep], value[keep], expected, slots[keep])
        got = cache.clone()
        tri.write_kv(key, value, got, slots)
        rec["rel_err"] = rel(got, expected.float())
        rec["pass"] = bool(torch.equal(got, expected))
        k2, v2, s2 = key[keep].contiguous(), value[keep].contiguous(), slots[keep].contiguous()
        rec["triton_ms"] = bench(lambda: tri.write_kv(key, value, got, slots))
        rec["torch_ms"] = bench(lambda: ref.write_kv(k2, v2, expected, s2))

    cases = tiny_cases() if args.tiny else real_cases()
    cases = [c for c in cases if args.only in c.name]
    info = {
        "device": torch.cuda.get_device_name() if on_gpu else f"cpu (Triton interpreter) {platform.processor()}",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tiny": args.tiny,
        "tolerances": TOL,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    results: list[dict] = []
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        tmp = out_path.with_suffix(out_path.suffix + ".tmp")
        tmp.write_text(json.dumps({"info": info, "results": results}, indent=1))
        os.replace(tmp, out_path)

    print(f"{info['device']} | torch {info['torch']} | triton {info['triton']} | {len(cases)} cases")
    for case in cases:
        num_heads, num_kv_heads, head_dim = MODELS[case.model]
        rec = {
            "name": case.name,
            "kind": case.kind,
            "model": case.model,
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "dtype": case.dtype,
            "block_size": case.block_size,
            "num_seqs": len(case.q_lens),
            "num_tokens": sum(case.q_lens),
            "max_seq_len": max(case.seq_lens, default=0),
            "tol": TOL[case.dtype],
            "pass": False,
        }
        t0 = time.perf_counter()
        try:
            if case.kind == "write":
                run_write(case, rec)
            elif case.kind == "graph":
                run_graph(case, rec)
            else:
                run_attention(case, rec)
        except Exception as e:  # record it and go on with the next shape
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc()
            print(rec["traceback"], file=sys.stderr)
        finally:
            if on_gpu:
                torch.cuda.empty_cache()
        rec["wall_s"] = round(time.perf_counter() - t0, 2)
        tri_ms, ref_ms = rec.get("triton_ms"), rec.get("torch_ms")
        if tri_ms and ref_ms:
            rec["speedup"] = ref_ms / tri_ms
        results.append(rec)
        save()
        status = "PASS" if rec["pass"] else ("ERROR" if "error" in rec else "FAIL")
        err = rec.get("rel_err")
        ref_err = rec.get("torch_ref_rel_err")
        fmt_ms = lambda x: f"{x:8.3f}" if isinstance(x, float) else "       -"
        print(
            f"{status:5} {case.name:52} rel_err={err if err is None else f'{err:.2e}'}"
            f" (torch16 {ref_err if ref_err is None else f'{ref_err:.2e}'}, tol {rec['tol']:.0e})"
            f" splits={rec.get('num_splits', '-')} triton_ms={fmt_ms(tri_ms)} torch_ms={fmt_ms(ref_ms)}"
            + (f"  {rec['error']}" if "error" in rec else ""),
            flush=True,
        )
    failed = [r["name"] for r in results if not r["pass"]]
    info["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    info["failed"] = failed
    save()
    print(f"{len(results) - len(failed)}/{len(results)} PASS; results in {out_path}")
    if failed:
        print("FAILED: " + "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
