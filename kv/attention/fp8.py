"""fp8 (e4m3) KV cache: storage format and the per-head scales.

A layer's cache holds ``float8_e4m3fn`` values ``round(x / scale)`` (saturated at +-448); reading
multiplies by ``scale`` again. Scales are static, one per (layer, K or V, KV head): a tensor
``kv_scale [2, num_kv_heads]`` float32 owned by the layer's attention module. They are fixed once, before
the first write (`core.models.quant.calibrate_kv_scales`): a forward pass over calibration tokens records
each head's largest ``|K|`` and ``|V|``, and ``scale = amax * KV_SCALE_HEADROOM / FP8_MAX``.

Why static: a scale that changed while a sequence lives would re-interpret the bytes already written
(every block would need its own scale, or a rescale pass). Why per head: heads differ in magnitude by
more than 10x in real models, and e4m3 has 3 mantissa bits over ~17 binades (subnormals included), so a
per-head scale keeps small heads out of the subnormal range where precision is lost. The headroom
keeps tokens larger than anything seen in calibration from saturating; it costs nothing at the top
of the range (relative precision is the same in every normal binade) and only moves the subnormal
threshold down by log2(headroom) binades.

Every writer rounds the same way (round to nearest even, saturate): the torch path with torch's own
cast, the Triton write kernel with an explicit rounding that agrees with it bit for bit.

Where the cache's error (and the early greedy drift it causes) comes from: e4m3's 3 mantissa bits on the keys,
not the scales. `scripts/fp8_kv_drift.py` rounds K and V separately with everything else equal: the keys carry
most of the divergence from the unquantized model (an error of ``q . k`` moves every logit of the softmax),
the values little; a larger headroom changes nothing (the relative precision of normal e4m3 values does not
depend on the scale) and a smaller one clips; a scale per token and head, the finest granularity, removes only
part of it, as does subtracting each head's mean key before rounding. Greedy runs that part do so where the
unquantized model's top two logits were nearly tied (`scripts/gpu_fp8_check.py agree --variant fp8-kv`).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Calibration amax is multiplied by this before it maps to FP8_MAX.
KV_SCALE_HEADROOM = 4.0

KV_CACHE_DTYPES = ("auto", "fp8")


def is_fp8(t: torch.Tensor | torch.dtype) -> bool:
    dtype = t if isinstance(t, torch.dtype) else t.dtype
    return dtype == FP8_DTYPE


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of the KV pool: the model's own for ``"auto"``, e4m3 for ``"fp8"``."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype: must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def scales_from_amax(amax: torch.Tensor, headroom: float = KV_SCALE_HEADROOM) -> torch.Tensor:
    """``[..., 2, num_kv_heads]`` per-head max |value| -> scales (never 0: an all-zero head gets 1)."""
    amax = amax.float()
    return torch.where(amax > 0, amax * headroom / FP8_MAX, torch.ones_like(amax))


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [tokens, num_kv_heads, head_dim]`` / ``scale [num_kv_heads]`` -> e4m3, saturated."""
    return (x.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 ``x [..., num_kv_heads, head_dim]`` times its head's ``scale [num_kv_heads]``, in ``dtype``."""
    return (x.float() * scale[:, None]).to(dtype)


def require_scale(kv_scale: torch.Tensor | None) -> torch.Tensor:
    if kv_scale is None:
        raise ValueError("kv_scale: an fp8 KV cache needs the layer's per-head scales")
    return kv_scale
