"""The fused-MoE Triton kernels at real shapes on the GPU, and the weight-read floor of a MoE model's decode step.

    python scripts/gpu_moe_check.py kernels --out moe_kernels.json            # H200/H100: check, graph, time
    python scripts/gpu_moe_check.py kernels --tiny                             # CPU smoke (Triton interpreter)
    python scripts/gpu_moe_check.py floor --model dummy:qwen3-30b-a3b --latency lat_b1.json
    python scripts/gpu_moe_check.py greedy --out moe_greedy.json              # GPU; --device cpu --small: CPU

``kernels``: one layer of Qwen3-30B-A3B (128 experts, 8 per token, H 2048, I 768) and of Mixtral-8x7B (8 experts,
2 per token, H 4096, I 14336) in bf16 with random weights and random routing, at 1 to 4096 tokens. Per case: the
Triton path against the torch loop, as ``max|triton - torch| / max|torch|`` (PASS under 2e-2); the median ms of
each (CUDA events; several weight copies cycled so that the L2 cache holds none of a decode step's experts);
the bytes of the experts the tokens chose and the bandwidth the Triton path reached on them. The fused routing
kernel against its torch steps (equal, timed). Then a decode step's MoE from router logits captured in a CUDA
graph under torch's sync debug mode "error" (any host read-back raises), replayed against eager and timed.
``--sweep`` also times a few tile configurations per case (to tune `fused_moe.gemm_config`). The few-token path
(`core/models/moe_decode.py`, router included) at 1 token and at its most, against the torch loop and timed beside
the router GEMM + grouped GEMMs it replaces (``--sweep``: its tiles at 1 token), and in a CUDA graph.

``floor``: the bytes a batch-1 decode step reads, from the model's parameters on the meta device: every weight but
the embedding table (a lookup reads one row) with only ``top_k`` experts of each MoE layer; over the GPU's measured
copy bandwidth (and the nominal one, ``--nominal-tbps``) that is the floor; with ``--latency`` (the JSON of ``sluice
bench latency --batch-size 1``) the step time beside it and their ratio.

``greedy``: Qwen3-MoE and Mixtral built by transformers at the real head size (128), random weights, fp32: the
engine's greedy tokens (batched; the first prompt also alone) against transformers' logits (`greedy_family`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SHAPES = {  # name: (experts, top_k, hidden, intermediate)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
TOKENS = (1, 8, 64, 512, 4096)
SWEEP = [
    # narrow N tiles with long K steps: at one token (batch-1 decode) the grid of the default (64-wide) tiles is
    # under one wave on Qwen3-30B-A3B's gate/up (8 experts x 12 tiles), so each program's read is latency-bound
    dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, num_warps=2, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3),
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
]


def _time_ms(fn, args_cycle, iters: int) -> float:
    """Median ms of ``fn(*args)`` over ``iters`` calls, cycling through ``args_cycle`` (cold weights each call)."""
    for a in args_cycle:
        fn(*a)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        a = args_cycle[i % len(args_cycle)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _layer(e: int, h: int, i: int, dtype, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g, device=device, dtype=dtype) / h**0.5
    w2 = torch.randn(e, h, i, generator=g, device=device, dtype=dtype) / i**0.5
    return w13, w2


def _inputs(t: int, e: int, k: int, h: int, dtype, device, seed: int):
    from sluice.core.models.fused_moe import route

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(t, h, generator=g, device=device, dtype=dtype)
    weights, ids = route(torch.randn(t, e, generator=g, device=device), k, renormalize=True)
    return x, weights, ids


def kernel_case(name: str, t: int, layers, dtype, device, sweep: bool, iters: int) -> dict:
    from sluice.core.models.fused_moe import gemm_config, torch_experts, triton_experts

    e, k, h, i = SHAPES[name]
    inputs = [_inputs(t, e, k, h, dtype, device, seed=s) for s in range(len(layers))]
    args = [(x, w13, w2, w, ids) for (x, w, ids), (w13, w2) in zip(inputs, layers)]
    want = torch_experts(*args[0]).float()
    got = triton_experts(*args[0]).float()
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
    row = dict(shape=name, tokens=t, rel_err=err, ok=err < 2e-2, config=gemm_config(t, k, e))
    if device.type != "cuda":
        return row
    row["triton_ms"] = _time_ms(triton_experts, args, iters)
    row["torch_ms"] = _time_ms(torch_experts, args, max(3, iters // 5))
    used = [ids.unique().numel() for (_, _, ids) in inputs]
    per_expert = 3 * h * i * layers[0][0].element_size()
    row["expert_bytes"] = statistics.mean(used) * per_expert
    row["triton_gbps"] = row["expert_bytes"] / row["triton_ms"] / 1e6
    if sweep:
        row["sweep"] = [
            dict(cfg, ms=_time_ms(lambda *a, c=cfg: triton_experts(*a, config=c), args, iters)) for cfg in SWEEP
        ]
    return row


def _captured(fn) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``fn()`` warmed twice on a side stream (Triton compiles outside the capture), then captured in a CUDA graph
    with sync debug "error" on (any host read-back raises): the graph and its output tensor."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return graph, out


def graph_check(name: str, layers, dtype, device, t: int = 1) -> dict:
    """A decode step's MoE from router logits (the fused routing kernel, both GEMMs) in a CUDA graph, captured
    with sync debug "error" on; replayed on other tokens routed to other experts, it equals eager."""
    from sluice.core.models.fused_moe import moe_forward

    e, k, h, _ = SHAPES[name]
    w13, w2 = layers[0]
    g = torch.Generator(device=device).manual_seed(99)
    x = torch.randn(t, h, generator=g, device=device, dtype=dtype)
    logits = torch.randn(t, e, generator=g, device=device, dtype=dtype)
    graph, out = _captured(lambda: moe_forward(x, logits, w13, w2, k, True, use_triton=True))
    x.copy_(torch.randn(t, h, generator=g, device=device, dtype=dtype))
    logits.copy_(torch.randn(t, e, generator=g, device=device, dtype=dtype))
    graph.replay()
    torch.cuda.synchronize()
    want = moe_forward(x, logits, w13, w2, k, True, use_triton=True)
    ref = moe_forward(x, logits, w13, w2, k, True, use_triton=False)
    err = ((want.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    replay_ms = _time_ms(graph.replay, [()], 50)
    equal = bool(torch.equal(out, want))
    return dict(shape=name, tokens=t, graph_equal=equal, rel_err_vs_torch=err, replay_ms=replay_ms)


def routing_case(name: str, t: int, device) -> dict:
    """The fused routing-and-sorting kernel against its torch steps (`route`, `align_pairs`): equal, and timed."""
    from sluice.core.models.fused_moe import align_pairs, route, route_and_align

    e, k, _, _ = SHAPES[name]
    logits = torch.randn(t, e, device=device)
    w, ids, aligned = route_and_align(logits, k, True, 16)
    want_w, want_ids = route(logits, k, True)
    want = align_pairs(want_ids, 16, e)
    same = torch.equal(ids.long(), want_ids) and all(torch.equal(a, b.to(a.dtype)) for a, b in zip(aligned, want))
    row = dict(shape=name, tokens=t, routing_equal=bool(same and torch.allclose(w, want_w)))
    if device.type == "cuda":
        row["fused_ms"] = _time_ms(lambda: route_and_align(logits, k, True, 16), [()], 50)
        row["torch_ms"] = _time_ms(lambda: align_pairs(route(logits, k, True)[1], 16, e), [()], 50)
    return row


DECODE_SWEEP = [  # the few-token path's tiles (`moe_decode.DecodeMoEConfig`): gate/up N tile and K step, down split
    dict(gate_up_block_n=16, gate_up_block_k=256),
    dict(gate_up_block_n=32, gate_up_block_k=128),
    dict(gate_up_block_n=64, gate_up_block_k=128),
    dict(split=1),
    dict(split=4),
    dict(down_block_k=128),
    dict(down_block_n=32),
    dict(num_stages=3),
    dict(num_warps=8),
]


def moe_decode_max(name: str) -> int:
    from sluice.core.models import moe_decode

    e, k, _, _ = SHAPES[name]
    return moe_decode.max_tokens(k, e)


def decode_case(name: str, t: int, layers, dtype, device, sweep: bool, iters: int) -> dict:
    """The few-token path (`moe_decode.decode_moe`: router, gate/up, down-sum) against `route` and the torch loop,
    and timed beside the path it replaces (the router's cuBLAS GEMM, then `moe_forward`'s routing kernel and
    grouped GEMMs), each on cold weights."""
    import torch.nn.functional as F
    from sluice.core.models import moe_decode
    from sluice.core.models.fused_moe import moe_forward, route, torch_experts

    e, k, h, i = SHAPES[name]
    g = torch.Generator(device=device).manual_seed(t)
    routers = [torch.randn(e, h, generator=g, device=device, dtype=dtype) / h**0.5 for _ in layers]
    xs = [torch.randn(t, h, generator=g, device=device, dtype=dtype) for _ in layers]
    counters = torch.zeros(moe_decode.counters_needed(k, e, h), dtype=torch.int32, device=device)
    (w13, w2), x, router = layers[0], xs[0], routers[0]
    weights, ids = route(F.linear(x, router), k, renormalize=True)
    want = torch_experts(x, w13, w2, weights, ids).float()
    got = moe_decode.decode_moe(x, router, w13, w2, k, True, counters).float()
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
    row = dict(shape=name, tokens=t, path="decode", rel_err=err, ok=err < 2e-2 and not counters.any().item())
    if device.type != "cuda":
        return row
    args = [(x, r, w13, w2) for x, r, (w13, w2) in zip(xs, routers, layers)]
    row["decode_ms"] = _time_ms(lambda x, r, a, b: moe_decode.decode_moe(x, r, a, b, k, True, counters), args, iters)
    row["grouped_ms"] = _time_ms(lambda x, r, a, b: moe_forward(x, F.linear(x, r), a, b, k, True, True), args, iters)
    used = statistics.mean(route(F.linear(x, r), k, True)[1].unique().numel() for x, r, _, _ in args)
    row["decode_gbps"] = used * 3 * h * i * w13.element_size() / row["decode_ms"] / 1e6
    if sweep:
        row["sweep"] = []
        for tiles in DECODE_SWEEP:
            cfg = moe_decode.DecodeMoEConfig(**tiles)
            ms = _time_ms(lambda *a, c=cfg: moe_decode.decode_moe(*a, k, True, counters, c), args, iters)
            row["sweep"].append(dict(tiles, ms=ms))
    return row


def decode_graph_check(name: str, layers, dtype, device) -> dict:
    """The few-token path in a CUDA graph (sync debug "error" while capturing): replayed on another token, routed
    to other experts, it equals eager, and its counters are back at zero."""
    from sluice.core.models import moe_decode

    e, k, h, _ = SHAPES[name]
    w13, w2 = layers[0]
    g = torch.Generator(device=device).manual_seed(98)
    x = torch.randn(1, h, generator=g, device=device, dtype=dtype)
    router = torch.randn(e, h, generator=g, device=device, dtype=dtype) / h**0.5
    counters = torch.zeros(moe_decode.counters_needed(k, e, h), dtype=torch.int32, device=device)
    graph, out = _captured(lambda: moe_decode.decode_moe(x, router, w13, w2, k, True, counters))
    x.copy_(torch.randn(1, h, generator=g, device=device, dtype=dtype))
    graph.replay()
    torch.cuda.synchronize()
    want = moe_decode.decode_moe(x, router, w13, w2, k, True, counters)
    equal = bool(torch.equal(out, want)) and not counters.any().item()
    return dict(shape=name, tokens=1, path="decode", graph_equal=equal, replay_ms=_time_ms(graph.replay, [()], 50))


GRAPH_KNOBS = {  # `moe_decode.DecodeMoEConfig`'s fields and the values `decode-sweep` tries for each (None: the rule)
    "router_block_e": (4, 8, 16, 32),
    "router_block_k": (128, 256, 512),
    "gate_up_block_n": (16, 32, 64, 128),
    "gate_up_block_k": (64, 128, 256, 512),
    "down_block_n": (16, 32, 64, 128),
    "down_block_k": (None, 64, 128),
    "split": (None, 1, 2, 4, 8),
    "num_warps": (2, 4, 8),
    "num_stages": (2, 3, 4, 5),
}


def _graph_layers_ms(step, layers, xs, routers) -> float:
    """Median ms per layer of ``step(x, router, w13, w2)`` over every copy of the layer in one CUDA graph (cold
    weights: the copies are more than L2 holds), as a decode step replays it."""
    graph, _ = _captured(lambda: [step(x, r, a, b) for x, r, (a, b) in zip(xs, routers, layers)])
    return _time_ms(graph.replay, [()], 30) / len(layers)


def decode_sweep_shape(name: str, rounds: int) -> dict:
    """One shape's coordinate descent over `GRAPH_KNOBS` (each knob in turn, the best kept, ``rounds`` times),
    timed in CUDA graphs beside the path the few-token one replaces (router GEMM + `moe_forward`)."""
    from dataclasses import asdict, replace

    import torch.nn.functional as F
    from sluice.core.models import moe_decode
    from sluice.core.models.fused_moe import moe_forward

    device, dtype = torch.device("cuda"), torch.bfloat16
    e, k, h, i = SHAPES[name]
    copies = max(2, int(4e9 // (3 * e * h * i * 2)))
    layers = [_layer(e, h, i, dtype, device, seed=c) for c in range(copies)]
    g = torch.Generator(device=device).manual_seed(7)
    xs = [torch.randn(1, h, generator=g, device=device, dtype=dtype) for _ in layers]
    routers = [torch.randn(e, h, generator=g, device=device, dtype=dtype) / h**0.5 for _ in layers]
    counters = torch.zeros(moe_decode.counters_needed(k, e, h), dtype=torch.int32, device=device)

    def grouped(x, r, a, b):
        return moe_forward(x, F.linear(x, r), a, b, k, True, True)

    def timed(cfg) -> float:
        try:
            return _graph_layers_ms(lambda *a: moe_decode.decode_moe(*a, k, True, counters, cfg), layers, xs, routers)
        except Exception as ex:  # a tile over the shared memory, a K step that does not divide I
            print(f"  {cfg}: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
            return float("inf")

    best = moe_decode.DecodeMoEConfig()
    best_ms = default_ms = timed(best)
    tried = [dict(asdict(best), ms=best_ms)]
    for _ in range(rounds):
        for knob, values in GRAPH_KNOBS.items():
            for v in values:
                if v != getattr(best, knob):
                    cfg = replace(best, **{knob: v})
                    tried.append(dict(asdict(cfg), ms=timed(cfg)))
                    print(f"  {name} {knob}={v}: {tried[-1]['ms'] * 1e3:.1f} us/layer", flush=True)
                    if tried[-1]["ms"] < best_ms:
                        best, best_ms = cfg, tried[-1]["ms"]
    return dict(
        shape=name,
        tokens=1,
        layers_in_graph=copies,
        grouped_ms_per_layer=_graph_layers_ms(grouped, layers, xs, routers),
        default_ms_per_layer=default_ms,
        best_ms_per_layer=best_ms,
        best=asdict(best),
        tried=tried,
    )


def run_decode_sweep(ns) -> int:
    results = []
    for name in ns.shapes:
        row = decode_sweep_shape(name, ns.rounds)
        print(json.dumps({k: v for k, v in row.items() if k != "tried"}), flush=True)
        results.append(row)
        torch.cuda.empty_cache()
    if ns.out:
        Path(ns.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def run_kernels(ns) -> int:
    device = torch.device("cpu" if ns.tiny else "cuda")
    dtype = torch.float32 if ns.tiny else torch.bfloat16
    shapes = {"tiny": (8, 2, 64, 48)} if ns.tiny else SHAPES
    SHAPES.update(shapes)
    results, failed = [], False
    for name in shapes:
        e, _, h, i = SHAPES[name]
        copies = 1 if ns.tiny else max(2, int(4e9 // (3 * e * h * i * 2)))  # ~4 GB of weights: L2 holds none
        layers = [_layer(e, h, i, dtype, device, seed=c) for c in range(copies)]
        for t in (1, 5) if ns.tiny else ns.tokens:
            row = kernel_case(name, t, layers, dtype, device, ns.sweep and not ns.decode_sweep, ns.iters)
            failed |= not row["ok"]
            print(json.dumps(row), flush=True)
            results.append(row)
        for t in (1, 5) if ns.tiny else (1, 8, 32):
            row = routing_case(name, t, device)
            failed |= not row["routing_equal"]
            print(json.dumps(row), flush=True)
            results.append(row)
        for t in sorted({1, moe_decode_max(name)}):
            row = decode_case(name, t, layers, dtype, device, (ns.sweep or ns.decode_sweep) and t == 1, ns.iters)
            failed |= not row["ok"]
            print(json.dumps(row), flush=True)
            results.append(row)
        if device.type == "cuda":
            row = decode_graph_check(name, layers, dtype, device)
            failed |= not row["graph_equal"]
            print(json.dumps(row), flush=True)
            results.append(row)
            for t in (1, 8, 200):  # 200: the torch sort (over 256 pairs) inside the graph
                row = graph_check(name, layers, dtype, device, t)
                failed |= not (row["graph_equal"] and row["rel_err_vs_torch"] < 2e-2)
                print(json.dumps(row), flush=True)
                results.append(row)
        del layers
    if ns.out:
        Path(ns.out).write_text(json.dumps(results, indent=2) + "\n")
    print("FAIL" if failed else "PASS")
    return int(failed)


def step_bytes(model: str, dtype_bytes: int = 2) -> dict:
    """What a batch-1 decode step of ``model`` reads: every weight but the embedding table, top_k of E experts."""
    from sluice.core.models.loader import resolve_model
    from sluice.core.models.moe import SparseMoeBlock
    from sluice.core.models.registry import model_class_for

    source = resolve_model(model)
    with torch.device("meta"):
        m = model_class_for(source.config)(source.config, max_position=4096)
    total = sum(p.numel() for p in m.parameters())
    embed = m.model.embed_tokens.weight.numel() if m.lm_head is not None else 0  # tied: the head reads it whole
    experts = active = 0
    for mod in m.modules():
        if isinstance(mod, SparseMoeBlock):
            n = mod.experts.gate_up_proj.numel() + mod.experts.down_proj.numel()
            experts += n
            active += n * mod.top_k // mod.experts.gate_up_proj.shape[0]
    read = total - embed - experts + active
    return dict(model=model, params=total, active_params=read, step_bytes=read * dtype_bytes)


def copy_tbps(device) -> float:
    """The device's bandwidth as a large copy reaches it (bytes read + written per second, in TB/s)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = _time_ms(lambda: b.copy_(a), [()], 20)
    return 2 * n / ms / 1e9


def _find(obj, key):
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            if (found := _find(v, key)) is not None:
                return found
    return None


def run_floor(ns) -> int:
    row = step_bytes(ns.model)
    row["nominal_tbps"] = ns.nominal_tbps
    row["floor_ms_nominal"] = row["step_bytes"] / ns.nominal_tbps / 1e9
    if torch.cuda.is_available():
        row["copy_tbps"] = copy_tbps(torch.device("cuda"))
        row["floor_ms_copy"] = row["step_bytes"] / row["copy_tbps"] / 1e9
    if ns.latency:
        step = _find(json.loads(Path(ns.latency).read_text()), "ms_per_output_token")
        row["step_ms"] = step
        if step:
            row["ratio_vs_floor_nominal"] = step / row["floor_ms_nominal"]
            if "floor_ms_copy" in row:
                row["ratio_vs_floor_copy"] = step / row["floor_ms_copy"]
    print(json.dumps(row, indent=2))
    if ns.out:
        Path(ns.out).write_text(json.dumps(row, indent=2) + "\n")
    return 0


def moe_configs(small: bool) -> dict:
    """family -> transformers config at the real head size (128; small: 32, CPU-sized), four layers, random weights:
    Qwen3-MoE with 64 experts of which 8 per token, one dense layer; Mixtral with 8 experts, 2 per token."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    head = 32 if small else 128
    base = dict(
        vocab_size=49152,  # the borrowed tokenizer's
        hidden_size=8 * head,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    return {
        "qwen3_moe": Qwen3MoeConfig(
            **base,
            head_dim=head,
            intermediate_size=24 * head,
            moe_intermediate_size=2 * head,
            num_experts=64,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            mlp_only_layers=[2],
            rms_norm_eps=1e-6,
        ),
        "mixtral": MixtralConfig(**base, intermediate_size=12 * head, num_local_experts=8, num_experts_per_tok=2),
    }


def _save_random(config, out: Path, seed: int):
    """transformers' model of ``config`` with random weights (norms around 1), saved with the default model's
    tokenizer; returned (fp32) as the reference."""
    import shutil

    from sluice.core.models.loader import default_tokenizer_dir
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else noise * 0.5 / p.shape[-1] ** 0.5)
    model.save_pretrained(out, safe_serialization=True)
    for f in Path(default_tokenizer_dir()).iterdir():
        shutil.copy(f, out / f.name)
    return model.eval()


def greedy_family(name: str, config, ns, work: Path) -> dict:
    """The engine's greedy tokens (its defaults: Triton attention, the fused MoE, CUDA graphs) against transformers'
    in fp32: every token the engine picks must be transformers' best there, or within ``--tol`` of it (teacher-forced
    along the engine's tokens: random weights make near ties)."""
    from sluice.core import LLM, SamplingParams

    d = work / name
    d.mkdir()
    ref = _save_random(config, d, seed=len(name)).to(ns.device)
    g = torch.Generator().manual_seed(1)
    lens = [40, 70] if ns.small else [100, 300, 700]
    prompts = [torch.randint(1000, 40000, (n,), generator=g).tolist() for n in lens]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    with LLM(model=str(d), device=ns.device, dtype="float32", max_model_len=2048, num_kv_blocks=512) as llm:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        solo = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:1]]
    shortfall = 0.0
    with torch.no_grad():
        for p, o in zip(prompts, outs, strict=True):
            logits = ref(torch.tensor([p + o], device=ns.device)).logits[0, len(p) - 1 : -1]
            picked = logits.gather(1, torch.tensor(o, device=ns.device)[:, None])[:, 0]
            shortfall = max(shortfall, (logits.max(dim=1).values - picked).max().item())
    row = dict(family=name, architecture=type(ref).__name__, head_dim=128 if not ns.small else 32, prompt_lens=lens)
    row.update(max_shortfall=shortfall, batched_equals_solo=solo[0] == outs[0], pass_=shortfall <= ns.tol)
    row["pass"] = row.pop("pass_") and row["batched_equals_solo"]
    print(json.dumps(row), flush=True)
    return row


def run_greedy(ns) -> int:
    import tempfile

    configs = moe_configs(ns.small)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [greedy_family(name, cfg, ns, Path(tmp)) for name, cfg in configs.items()]
    ok = all(r["pass"] for r in rows)
    print("PASS" if ok else "FAIL")
    if ns.out:
        Path(ns.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--tiny", action="store_true", help="CPU smoke through the Triton interpreter")
    k.add_argument("--sweep", action="store_true", help="also time the tile configurations of SWEEP")
    k.add_argument("--decode-sweep", action="store_true", help="sweep the few-token path's tiles only")
    k.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="the grouped GEMM's token counts")
    k.add_argument("--iters", type=int, default=30)
    k.add_argument("--out", default=None)
    f = sub.add_parser("floor")
    f.add_argument("--model", required=True)
    f.add_argument("--latency", default=None, help="a `sluice bench latency --batch-size 1` JSON")
    f.add_argument("--nominal-tbps", type=float, default=4.8, help="HBM bandwidth (H200 4.8, H100 SXM 3.35)")
    f.add_argument("--out", default=None)
    d = sub.add_parser("decode-sweep", help="the few-token path's tiles in CUDA graphs, by coordinate descent")
    d.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    d.add_argument("--rounds", type=int, default=2)
    d.add_argument("--out", default=None)
    g = sub.add_parser("greedy")
    g.add_argument("--device", default="cuda")
    g.add_argument("--small", action="store_true", help="CPU-sized models (head size 32)")
    g.add_argument("--tol", type=float, default=1e-3, help="largest logit shortfall of a picked token (fp32)")
    g.add_argument("--out", default=None)
    ns = p.parse_args()
    return {"kernels": run_kernels, "floor": run_floor, "greedy": run_greedy, "decode-sweep": run_decode_sweep}[ns.cmd](
        ns
    )


if __name__ == "__main__":
    sys.exit(main())
