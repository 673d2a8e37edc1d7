"""Sweep launch configs of the decode-path kernels at Llama-3-8B shapes, timed as the engine runs them.

    python scripts/gpu_kernel_sweep.py gemv --out gemv_sweep.json     # int4 GEMV (batch-1 decode)
    python scripts/gpu_kernel_sweep.py attn --out attn_sweep.json     # paged attention, fp8 vs bf16 cache
    python scripts/gpu_kernel_sweep.py pdl --out pdl_sweep.json       # int4 GEMV with / without PDL
    python scripts/gpu_kernel_sweep.py dense --out dense_sweep.json   # bf16 GEMV (1-16 rows) vs F.linear

Timing: the calls under test are captured back to back in one CUDA graph (as a decode step replays them,
without launch gaps) and the graph is replayed; the figure is the median replay over the calls in it. The
GEMV rotates over copies of its weights whose total exceeds the GPU's L2 cache, so every call reads its
weights from memory as in a decode step (`quant_kernel_check.py` times one launch at a time with
``do_bench``, whose launch overhead dominates the small projections and whose figures moved by up to 1.7x
between runs). Every config's output is checked against the exact product (GEMV) or against the same
launch with the default config (attention) before it is timed.

``gemv``: int4 (group 128) on the tensor cores (layout ``tcx``) over a grid of tile sizes, split-K and
pipeline depths, the engine's current candidates (`GEMV_CONFIGS`), and bf16 ``F.linear`` on the same
shapes. ``attn``: the decode kernel (block size, warps, stages, split count) and the prefill kernel (tiles),
each config on a bf16 and an fp8 cache of the same contexts, timed alternately. ``pdl``: the engine's int4 config
(`int4_gemv_config`) without programmatic dependent launch and with it at several L2 prefetch depths
(`kv/attention/pdl.py`), each GEMV behind a fused RMSNorm as in a decoder layer (the norm lets it start early);
bf16 ``F.linear`` behind the same norm for scale. Results are rewritten to ``--out`` after every shape or case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quant_kernel_check import LINEAR_SHAPES, TINY_SHAPES, _cfg, _rel  # noqa: E402 - the check's shapes and helpers

L2_BYTES = 200 * 2**20  # rotate over at least this many weight bytes (the H200's L2 is 50 MiB)


def graph_ms(calls, replays: int = 15) -> float:
    """Median time of one call, ``calls`` (callables) captured back to back in one CUDA graph (on the CPU,
    ``--tiny``: each call run once, untimed)."""
    import torch

    if not torch.cuda.is_available():
        for c in calls:
            c()
        return float("nan")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture: compiles, allocator pools
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times) / len(calls)


def gemv_configs(n: int):
    from sluice.core.models.quant_kernels import GEMV_CONFIGS, GemvConfig

    grid = []
    for block_n, warps in ((32, 4), (64, 4), (128, 4), (128, 8)):
        for row_bytes in (128, 256, 512) if block_n <= 64 else (128, 256):  # 512: 8 groups fill the MMA's n = 8
            for split in (1, 2, 4, 8):
                if split > 1 and n >= 16384:  # enough tiles already
                    continue
                if split == 8 and (n > 6144 or block_n > 64):
                    continue
                for stages in (3, 4):
                    grid.append(GemvConfig(block_n, row_bytes, split, warps, "tcx", stages))
    current = [c for c in GEMV_CONFIGS if c not in grid and c.layout in ("3d", "tcx")]
    return current + grid


def sweep_gemv(ns) -> dict:
    import torch

    out = {"shapes": {}}
    g = torch.Generator(device=ns.device).manual_seed(0)
    for name, (n, k) in (TINY_SHAPES if ns.tiny else LINEAR_SHAPES).items():
        if ns.shapes and name not in ns.shapes:
            continue
        out["shapes"][name] = _gemv_shape(ns, g, n, k)
        best = out["shapes"][name]["best"]
        print(f"{name} {n}x{k}: bf16 {out['shapes'][name]['bf16_ms'] * 1e3:.1f} us", flush=True)
        for r in best[:4]:
            print(f"    int4 {r['ms'] * 1e3:.1f} us ({r['tb_s']:.2f} TB/s) {r['config']}", flush=True)
        _write(ns.out, out)
        torch.cuda.empty_cache()
    if set(out["shapes"]) == set(LINEAR_SHAPES):  # one decode step: 32 layers x 4 projections + the LM head
        sh = out["shapes"]
        layer = ("qkv", "o", "gate_up", "down")
        out["decode_step_matmuls_ms"] = {
            "int4_best": 32 * sum(sh[s]["best"][0]["ms"] for s in layer) + sh["lm_head"]["best"][0]["ms"],
            "bf16": 32 * sum(sh[s]["bf16_ms"] for s in layer) + sh["lm_head"]["bf16_ms"],
        }
        print("decode step matmuls (ms):", out["decode_step_matmuls_ms"], flush=True)
    return out


def _gemv_shape(ns, g, n: int, k: int) -> dict:
    import torch
    from sluice.core.models import quant_kernels as qk
    from sluice.core.models.quant import dequantize_int4

    dev, group = ns.device, 128
    nbytes, ws = _int4_copies(ns, g, n, k, group)
    copies = len(ws)
    x = torch.randn(1, k, device=dev, generator=g).bfloat16()
    ref = x.float() @ dequantize_int4(*ws[0], torch.float32).t()
    cnt = torch.zeros(-(-n // 4), dtype=torch.int32, device=dev)
    dense = _bf16_copies(ns, g, n, k)
    bf16_ms = graph_ms([lambda w=w: torch.nn.functional.linear(x, w) for w in dense])
    del dense
    rows = []
    t_start = time.perf_counter()  # the limit is per shape: later shapes reuse the compiled kernels
    for cfg in gemv_configs(n):
        if ns.time_limit and time.perf_counter() - t_start > ns.time_limit:
            break
        tuner = qk.GemvTuner(configs=(cfg,))
        tuner.choice[("int4", n, k, group)] = cfg
        row = {"config": _cfg(cfg)}
        try:
            y = qk.int4_matmul(x, *ws[0], group, None, cnt, tuner)
            row["rel_err"] = _rel(y, ref)
            if row["rel_err"] > 1e-2 or bool(cnt.any()):
                row["error"] = "wrong result" if row["rel_err"] > 1e-2 else "counters not reset"
            else:
                calls = [lambda w=w, t=tuner: qk.int4_matmul(x, *w, group, None, cnt, t) for w in ws]
                row["ms"] = graph_ms(calls)
                row["tb_s"] = nbytes / row["ms"] / 1e9
        except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is skipped
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    timed = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    return {
        "n": n, "k": k, "weight_bytes": nbytes, "copies": copies,
        "bf16_ms": bf16_ms, "bf16_tb_s": n * k * 2 / bf16_ms / 1e9,
        "best": timed[:5], "num_configs": len(rows), "errors": [r for r in rows if "error" in r][:5],
        "all": rows,
    }  # fmt: skip


def _int4_copies(ns, g, n: int, k: int, group: int) -> tuple[int, list]:
    """(bytes of one int4 ``n x k`` weight, its scales and mins; enough random copies of it to exceed L2)."""
    import torch

    nbytes = n * k // 2 + 2 * 2 * n * (k // group)
    copies = 2 if ns.tiny else max(2, -(-L2_BYTES // nbytes))
    return nbytes, [
        (
            torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=ns.device, generator=g),
            (torch.rand(n, k // group, device=ns.device, generator=g) * 0.002 + 0.001).half(),
            (torch.rand(n, k // group, device=ns.device, generator=g) * -0.01).half(),
        )
        for _ in range(copies)
    ]


def _bf16_copies(ns, g, n: int, k: int) -> list:
    """Enough random bf16 ``n x k`` weights to exceed L2 (the dense peer of `_int4_copies`)."""
    import torch

    copies = 2 if ns.tiny else max(2, -(-L2_BYTES // (n * k * 2)))
    return [torch.randn(n, k, device=ns.device, generator=g).bfloat16() for _ in range(copies)]


PDL_VARIANTS = (("off", False, 0), ("on, no prefetch", True, 0), ("on, 512 B/row", True, 512),
                ("on, 1 KiB/row", True, 1024), ("on, 4 KiB/row", True, 4096))  # fmt: skip


def sweep_pdl(ns) -> dict:
    import torch

    out = {"shapes": {}, "variants": [v[0] for v in PDL_VARIANTS]}
    g = torch.Generator(device=ns.device).manual_seed(0)
    num_sms = 8 if ns.tiny else torch.cuda.get_device_properties(0).multi_processor_count
    for name, (n, k) in (TINY_SHAPES if ns.tiny else LINEAR_SHAPES).items():
        if ns.shapes and name not in ns.shapes:
            continue
        out["shapes"][name] = _pdl_shape(ns, g, n, k, num_sms)
        _write(ns.out, out)
        torch.cuda.empty_cache()
    if set(out["shapes"]) == set(LINEAR_SHAPES):
        sh, layer = out["shapes"], ("qkv", "o", "gate_up", "down")
        out["decode_step_ms_with_norms"] = {
            label: (32 * sum(sh[s][label].get("with_norm_us", float("nan")) for s in layer)
                    + sh["lm_head"][label].get("with_norm_us", float("nan"))) / 1e3
            for label, _, _ in PDL_VARIANTS
        }  # fmt: skip
        print("decode step, matmuls + a norm before each (ms):", out["decode_step_ms_with_norms"], flush=True)
    return out


def _pdl_shape(ns, g, n: int, k: int, num_sms: int) -> dict:
    import dataclasses

    import torch
    from sluice.core.models import quant_kernels as qk
    from sluice.core.models.fused import add_rmsnorm
    from sluice.core.models.quant import dequantize_int4

    group = 128
    nbytes, ws = _int4_copies(ns, g, n, k, group)
    x = torch.randn(1, k, device=ns.device, generator=g).bfloat16()
    norm_w = torch.ones(k, device=ns.device, dtype=torch.bfloat16)
    cnt = torch.zeros(-(-n // 4), dtype=torch.int32, device=ns.device)

    def normed() -> torch.Tensor:  # a fused RMSNorm, as before q/k/v and gate/up in a layer
        return add_rmsnorm(x, None, norm_w, 1e-5)[0]

    ref = normed().float() @ dequantize_int4(*ws[0], torch.float32).t()
    dense = _bf16_copies(ns, g, n, k)
    bf16_ms = graph_ms([lambda w=w: torch.nn.functional.linear(normed(), w) for w in dense])
    del dense
    rule = qk.int4_gemv_config(n, k, num_sms)
    row = {"n": n, "k": k, "weight_bytes": nbytes, "config": _cfg(rule), "bf16_with_norm_us": 1e3 * bf16_ms}
    print(f"{n}x{k} {_cfg(rule)}: bf16 + norm {1e3 * bf16_ms:.1f} us", flush=True)
    for label, pdl, prefetch in PDL_VARIANTS:
        tuner = qk.GemvTuner(configs=(dataclasses.replace(rule, pdl=pdl, prefetch=prefetch),))
        tuner.choice[("int4", n, k, group)] = tuner.configs[0]
        res = {}
        try:
            res["rel_err"] = _rel(qk.int4_matmul(normed(), *ws[0], group, None, cnt, tuner), ref)
            res["counters_reset"] = not bool(cnt.any())
            calls = [lambda w=w, t=tuner: qk.int4_matmul(normed(), *w, group, None, cnt, t) for w in ws]
            res["with_norm_us"] = 1e3 * graph_ms(calls)
            calls = [lambda w=w, t=tuner: qk.int4_matmul(x, *w, group, None, cnt, t) for w in ws]
            res["alone_us"] = 1e3 * graph_ms(calls)
            if not ns.tiny:
                res["graph_fresh_input_rel_err"] = _pdl_race_check(x, norm_w, ws[0], group, cnt, tuner)
        except Exception as e:  # noqa: BLE001 - report and go on
            res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row[label] = res
        print(f"    {label:>16}: {res}", flush=True)
    return row


def _pdl_race_check(x, norm_w, w, group: int, cnt, tuner) -> float:
    """Worst relative error of ``gemv(norm(x))`` replayed as one CUDA graph with a new ``x`` before each of 4
    replays: a GEMV that read its input before the norm had written it would see the last replay's."""
    import torch
    from sluice.core.models import quant_kernels as qk
    from sluice.core.models.fused import add_rmsnorm
    from sluice.core.models.quant import dequantize_int4

    x_static = x.clone()
    w_ref = dequantize_int4(*w, torch.float32).t()
    graph = torch.cuda.CUDAGraph()
    qk.int4_matmul(add_rmsnorm(x_static, None, norm_w, 1e-5)[0], *w, group, None, cnt, tuner)  # compiled
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        y = qk.int4_matmul(add_rmsnorm(x_static, None, norm_w, 1e-5)[0], *w, group, None, cnt, tuner)
    worst = 0.0
    for i in range(4):
        x_static.copy_(torch.randn_like(x, dtype=torch.float32).bfloat16() * (i + 1))
        graph.replay()
        ref = add_rmsnorm(x_static, None, norm_w, 1e-5)[0].float() @ w_ref
        worst = max(worst, _rel(y, ref))
    del graph
    return worst


def sweep_attn(ns) -> dict:
    import torch
    from sluice.kv.attention.triton_backend import TritonAttentionBackend

    dev = ns.device
    heads, kv_heads, d = (4, 2, 32) if ns.tiny else (32, 8, 128)
    g = torch.Generator().manual_seed(2)
    scale = (torch.rand(2, kv_heads, generator=g) * 0.05 + 0.01).to(dev)
    be = TritonAttentionBackend()
    cases = (
        {
            "decode b4 tiny": ([40, 17, 70, 9], None),
            "prefill tiny": ([40, 33], [40, 20]),
        }
        if ns.tiny
        else {
            "decode b64 ctx<=2048": ([2048] + torch.randint(1, 2048, (63,), generator=g).tolist(), None),
            "decode b128 ctx<=1024": ([1024] + torch.randint(64, 1024, (127,), generator=g).tolist(), None),
            "prefill 4x1024": ([1024] * 4, [1024] * 4),
        }
    )
    out = {"cases": {}}
    for label, (seq_lens, q_lens) in cases.items():
        out["cases"][label] = _attn_case(ns, be, scale, seq_lens, q_lens, (heads, kv_heads, d))
        case = out["cases"][label]
        best = case["best"]
        print(f"{label}: best bf16 {_fmt(best['bf16'], 'bf16')}; best fp8 {_fmt(best['fp8'], 'fp8')}", flush=True)
        print(f"    engine default {case['default']}", flush=True)
        _write(ns.out, out)
    return out


def _attn_case(ns, be, scale, seq_lens: list[int], q_lens: list[int] | None, shape: tuple[int, int, int]) -> dict:
    import torch
    from sluice.kv.attention import fp8
    from sluice.kv.attention import triton_kernels as tk

    from tests.helpers import random_paged_batch

    heads, kv_heads, d = shape
    decode = q_lens is None
    q_lens = q_lens or [1] * len(seq_lens)
    q, cache, meta = random_paged_batch(seq_lens, q_lens, kv_heads, heads // kv_heads, d, dtype=torch.bfloat16,
                                        device=ns.device)  # fmt: skip
    cache = cache.float() * 3
    c8 = torch.stack([fp8.quantize(cache[i].reshape(-1, kv_heads, d), scale[i]).reshape(cache[i].shape)
                      for i in range(2)])  # fmt: skip
    c16 = torch.stack([fp8.dequantize(c8[i], scale[i], torch.bfloat16) for i in range(2)])
    outb = torch.empty_like(q)
    num_seqs = len(seq_lens)
    heuristic = be.decode_splits(max(seq_lens), num_seqs, kv_heads, q.device)
    # a CUDA graph plans its splits for the longest context served (max_model_len; 8,192 by default)
    graphed = be.decode_splits(8192, num_seqs, kv_heads, q.device)
    if decode:
        configs = [dict(block_n=bn, num_warps=w, num_stages=st, splits=sp)
                   for bn, w in ((32, 4), (64, 4), (128, 4), (128, 8))
                   for st in (2, 3) for sp in sorted({1, heuristic, graphed})]  # fmt: skip
        default = dict(block_n=128, num_warps=4, num_stages=3, splits=graphed)  # the engine's, in a graph

        counters = torch.zeros(num_seqs * kv_heads, dtype=torch.int32, device=q.device)  # the engine's fused reduce

        def launch(c, kvc, sc, out_t=outb):
            tk.paged_decode(q, kvc, meta.block_tables, meta.seq_lens, meta.query_start_loc, out_t, d**-0.5,
                            num_seqs, c["splits"], block_n=c["block_n"], num_warps=c["num_warps"],
                            num_stages=c["num_stages"], kv_scale=sc, counters=counters)  # fmt: skip
    else:
        configs = [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
                   for bm, bn, w in ((64, 64, 4), (128, 64, 8), (64, 128, 4), (128, 128, 8))
                   for st in (1, 2)]  # fmt: skip
        default = dict(block_m=64, block_n=64, num_warps=4, num_stages=2)

        def launch(c, kvc, sc, out_t=outb):
            tk.paged_prefill(q, kvc, meta.block_tables, meta.seq_lens, meta.query_start_loc, out_t, d**-0.5,
                             num_seqs, block_m=c["block_m"], block_n=c["block_n"],
                             num_warps=c["num_warps"], num_stages=c["num_stages"], kv_scale=sc)  # fmt: skip

    refs = {}
    rows = []
    t_start = time.perf_counter()
    for c in configs:
        if ns.time_limit and time.perf_counter() - t_start > ns.time_limit:
            break
        row = dict(c)
        for dt, kvc, sc in (("bf16", c16, None), ("fp8", c8, scale)):
            try:
                o = torch.empty_like(q)
                launch(c, kvc, sc, o)
                if dt not in refs:
                    refs[dt] = o.float().clone()
                err = float((o.float() - refs[dt]).abs().max() / refs[dt].abs().max())
                if err > 2e-2:
                    row[f"{dt}_error"] = f"differs from the first config by {err:.3g}"
                    continue
                row[f"{dt}_us"] = 1e3 * graph_ms([lambda c=c, kvc=kvc, sc=sc: launch(c, kvc, sc)] * 10)
            except Exception as e:  # noqa: BLE001
                row[f"{dt}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    best = {dt: min((r for r in rows if f"{dt}_us" in r), key=lambda r: r[f"{dt}_us"], default=None)
            for dt in ("bf16", "fp8")}  # fmt: skip
    cur = next((r for r in rows if all(r.get(k) == v for k, v in default.items())), None)
    return {"kv_bytes_fp8": sum(seq_lens) * kv_heads * d * 2, "heuristic_splits": heuristic if decode else None,
            "default": cur, "best": best, "rows": rows}  # fmt: skip


def sweep_dense(ns) -> dict:
    """bf16 weights, 1-64 rows (``--rows``; the engine takes it to 32): the GEMV of `core/models/gemv.py` over a
    grid of configs (every one at the first row count; the four best of those, and the engine's rule, at more
    rows; only the rule with ``--rule-only``) against ``F.linear``, each call behind a fused RMSNorm as in a
    decoder layer."""
    import torch
    from sluice.core.models.gemv import gemv_config

    out = {"shapes": {}}
    g = torch.Generator(device=ns.device).manual_seed(0)
    num_sms = 8 if ns.tiny else torch.cuda.get_device_properties(0).multi_processor_count
    shapes = TINY_SHAPES if ns.tiny else LINEAR_SHAPES
    if ns.nk:  # other models' projections, NAME:N:K
        shapes = {name: (int(n), int(k)) for name, n, k in (s.split(":") for s in ns.nk)}
    for name, (n, k) in shapes.items():
        if ns.shapes and name not in ns.shapes:
            continue
        out["shapes"][name] = _dense_shape(ns, g, n, k, lambda m, n=n, k=k: gemv_config(n, k, num_sms, m))
        _write(ns.out, out)
        torch.cuda.empty_cache()
    if set(out["shapes"]) == set(LINEAR_SHAPES):  # one decode step: 32 layers x 4 projections + the LM head
        sh, layer = out["shapes"], ("qkv", "o", "gate_up", "down")
        totals = {}
        for m in sh["qkv"]["rows"]:
            for label in ("bf16_us", "rule_us", "best_us"):
                per = [sh[s]["rows"][m].get(label, float("nan")) for s in (*layer, "lm_head")]
                totals[f"m{m}_{label[:-3]}_ms"] = (32 * sum(per[:4]) + per[4]) / 1e3
        out["decode_step_matmuls_with_norms_ms"] = totals
        print("decode step, matmuls + a norm before each (ms):", totals, flush=True)
    return out


def _dense_cfg(c) -> list:
    return [c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages]


def _dense_shape(ns, g, n: int, k: int, rule_for) -> dict:
    """``rule_for(m)``: the engine's config at ``m`` rows."""
    import torch
    from sluice.core.models.fused import add_rmsnorm
    from sluice.core.models.gemv import GemvConfig, gemv

    ws = _bf16_copies(ns, g, n, k)
    cnt = torch.zeros(-(-n // 32), dtype=torch.int32, device=ns.device)
    norm_w = torch.ones(k, device=ns.device, dtype=torch.bfloat16)
    grid = [
        GemvConfig(bn, bk, split, warps, stages)
        for bn in (32, 64, 128) for bk in (64, 128, 256) for split in (1, 2, 4, 8) for stages in (3, 4)
        for warps in (4, 8)
        if not (split > 1 and n >= 16384) and not (warps == 8 and bn == 32)  # enough tiles already; too small a tile
    ]  # fmt: skip
    rows = (1, 3, 17) if ns.tiny else tuple(ns.rows)
    row = {"n": n, "k": k, "weight_bytes": n * k * 2, "copies": len(ws), "rows": {}}
    ranked: list = []
    for m in rows:
        x = torch.randn(m, k, device=ns.device, generator=g).bfloat16()

        def normed(x=x) -> torch.Tensor:
            return add_rmsnorm(x, None, norm_w, 1e-5)[0]

        ref = normed().float() @ ws[0].float().t()
        r = {"bf16_us": 1e3 * graph_ms([lambda w=w: torch.nn.functional.linear(normed(), w) for w in ws])}
        r["norm_us"] = 1e3 * graph_ms([normed for _ in ws])
        rule = rule_for(m)
        r["rule"] = _dense_cfg(rule)
        if ns.rule_only:
            configs = [rule]
        else:
            configs = grid if m == rows[0] else list(dict.fromkeys([*ranked[:4], rule]))
        t0, timed = time.perf_counter(), []
        for c in configs:
            if ns.time_limit and time.perf_counter() - t0 > ns.time_limit:
                break
            try:
                err = _rel(gemv(normed(), ws[0], None, cnt, c), ref)
                if err > 2e-2 or cnt.any():
                    r.setdefault("wrong", []).append({"config": _dense_cfg(c), "rel_err": err})
                    cnt.zero_()
                    continue
                us = 1e3 * graph_ms([lambda w=w, c=c: gemv(normed(), w, None, cnt, c) for w in ws])
                timed.append((us, c, err))
            except Exception as e:  # noqa: BLE001 - a config that fails is no candidate
                r.setdefault("errors", []).append(f"{_dense_cfg(c)}: {type(e).__name__}: {str(e)[:200]}")
        timed.sort(key=lambda t: t[0])
        if m == rows[0]:
            ranked = [c for _, c, _ in timed]
        r["best"] = [
            {"config": _dense_cfg(c), "us": us, "tb_s": n * k * 2 / us / 1e6, "rel_err": e} for us, c, e in timed[:5]
        ]
        r["best_us"] = timed[0][0] if timed else float("nan")
        r["rule_us"] = next((us for us, c, _ in timed if c == rule), float("nan"))
        row["rows"][m] = r
        print(f"{n}x{k} m={m}: bf16 {r['bf16_us']:.1f} us (norm {r['norm_us']:.1f}), rule {r['rule_us']:.1f}, "
              f"best {r['best'][:2]}", flush=True)  # fmt: skip
    return row


def _fmt(row, dt) -> str:
    if row is None:
        return "none"
    cfg = {k: v for k, v in row.items() if not k.endswith(("_us", "_error"))}
    return f"{row[dt + '_us']:.1f} us {cfg}"


def _write(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1, default=str) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("gemv", "attn", "pdl", "dense"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="*", help="gemv: only these shapes (qkv o gate_up down lm_head)")
    ap.add_argument("--time-limit", type=float, default=0, help="per shape or case: no more configs after this (s)")
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU (Triton interpreter smoke)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="dense: rows of x")
    ap.add_argument("--rule-only", action="store_true", help="dense: time only the engine's rule (and F.linear)")
    ap.add_argument("--nk", nargs="*", help="dense: these shapes instead of Llama-3-8B's, NAME:N:K (qkv:5120:2048)")
    ns = ap.parse_args()
    import torch

    ns.device = "cpu" if ns.tiny else "cuda"
    if not ns.tiny and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --tiny with TRITON_INTERPRET=1)")
        return 2
    from sluice.app.bench.results import machine_info, utc_now_iso, versions

    result = {"gemv": sweep_gemv, "attn": sweep_attn, "pdl": sweep_pdl, "dense": sweep_dense}[ns.what](ns)
    result.update(command=" ".join(["python scripts/gpu_kernel_sweep.py", *sys.argv[1:]]), machine=machine_info(),
                  versions=versions(), date=utc_now_iso())  # fmt: skip
    _write(ns.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
