"""Where the fp8 KV cache's error comes from, on the default model (CPU, teacher-forced on held-out ShareGPT).

    python scripts/fp8_kv_drift.py --num-tokens 2000 --out kv_drift.json

The model runs with a model-dtype cache; each variant rounds the keys and/or values to e4m3 on their way into it
(quantize then dequantize with the variant's scales), so one run isolates K from V and compares scale choices
with everything else equal. Per variant: the share of positions whose argmax equals the unquantized model's, and
the mean KL divergence of the next-token distribution from it.

Variants: ``k+v`` (the engine's scheme: static per-head scales from `calibrate_kv_scales`, headroom 4), ``k`` and
``v`` alone, headroom 1 and 16, ``dynamic`` (a scale per token and head, amax / 448: the finest granularity, which
would need a scale stored beside every token), and ``smooth-k`` (each head's calibration mean of K subtracted before
rounding: exact for attention, since ``q . mu`` is the same for every key of a query and softmax ignores it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("k+v", "k", "v", "headroom-1", "headroom-16", "dynamic", "smooth-k")


def _round(x, scale):
    """``x [T, H, D]`` rounded to e4m3 with per-head ``scale [H]`` (or per token and head ``[T, H, 1]``) and back."""
    import torch

    s = scale[:, None] if scale.dim() == 1 else scale
    return (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s


def calibration_stats(runner) -> dict:
    """Per-head scales at headroom 1, 4 and 16 (`calibrate_kv_scales`), each layer's mean key per head and channel
    over the calibration tokens (post-RoPE), and per-head scales of the keys less that mean (headroom 4)."""
    import torch
    from sluice.core.models.quant import calibrate_kv_scales

    backend = runner.backend
    layer_of = {}
    keys: dict[int, list] = {}
    write = backend.write_kv

    def recording(key, value, kv_cache, slot_mapping, kv_scale=None):
        i = layer_of.setdefault(kv_cache.data_ptr(), len(layer_of))
        keys.setdefault(i, []).append(key.float().clone())
        write(key, value, kv_cache, slot_mapping, kv_scale)

    scales = {h: calibrate_kv_scales(runner.model, backend, runner.dtype, runner.device, headroom=h) for h in (1, 16)}
    backend.write_kv = recording
    try:
        scales[4] = calibrate_kv_scales(runner.model, backend, runner.dtype, runner.device, headroom=4.0)
    finally:
        del backend.write_kv  # the class's method again
    for layer in runner.model.model.layers:
        layer.self_attn.kv_scale = None  # a model-dtype cache; the variants round on the way in
    mu = {i: torch.cat(k).mean(0) for i, k in keys.items()}
    smooth = {i: (torch.cat(k) - mu[i]).abs().amax(dim=(0, 2)) * 4.0 / 448 for i, k in keys.items()}
    return {"scales": scales, "mu": mu, "smooth_scale": smooth}


def rounding(runner, stats: dict, variant: str):
    """A ``write_kv`` that rounds keys and values as ``variant`` says before storing them."""
    write = runner.backend.write_kv
    layer_of = {c.data_ptr(): i for i, c in enumerate(runner.kv_caches)}
    head = {"headroom-1": 1, "headroom-16": 16}.get(variant, 4)

    def write_kv(key, value, kv_cache, slot_mapping, kv_scale=None):
        i = layer_of[kv_cache.data_ptr()]
        s = stats["scales"][head][i]
        if variant == "dynamic":
            key = _round(key, key.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448)
            value = _round(value, value.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448)
        elif variant == "smooth-k":
            key, value = _round(key - stats["mu"][i], stats["smooth_scale"][i]), _round(value, s[1])
        else:
            key = key if variant == "v" else _round(key, s[0])
            value = value if variant == "k" else _round(value, s[1])
        write(key.to(kv_cache.dtype), value.to(kv_cache.dtype), kv_cache, slot_mapping)

    return write_kv


def main() -> int:
    import torch.nn.functional as F
    from sluice.app.bench.perplexity import heldout_windows, window_logits
    from sluice.core.args import EngineArgs
    from sluice.core.frontend.tokenizer import load_tokenizer
    from sluice.core.models.loader import resolve_model
    from sluice.core.worker.model_runner import ModelRunner

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-tokens", type=int, default=2000)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    source = resolve_model(ns.model)
    windows = heldout_windows(load_tokenizer(source.tokenizer_dir), ns.num_tokens, 256)
    runner = ModelRunner(EngineArgs(model=ns.model, device="cpu", num_kv_blocks=16, max_model_len=256), source, 256)
    base = [window_logits(runner, w) for w in windows]
    stats = calibration_stats(runner)
    rows, total = [], sum(len(w) for w in windows)
    for variant in ns.variants.split(","):
        runner.backend.write_kv = rounding(runner, stats, variant)
        agree = kl = 0.0
        for w, b in zip(windows, base):
            logits = window_logits(runner, w)
            agree += float((logits.argmax(-1) == b.argmax(-1)).sum())
            kl += float(F.kl_div(F.log_softmax(logits, -1), F.log_softmax(b, -1), log_target=True, reduction="sum"))
        del runner.backend.write_kv
        rows.append({"variant": variant, "top1_agreement": agree / total, "kl_per_token": kl / total})
        print(json.dumps(rows[-1]), flush=True)
    if ns.out:
        Path(ns.out).write_text(json.dumps({"model": ns.model, "tokens": total, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
