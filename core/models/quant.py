"""Quantization of a loaded model, and the static scales of an fp8 KV cache.

``quantize_model(model, "fp8")`` makes every linear layer but the LM head an fp8 W8A8 `Fp8Linear`
(`core/models/fp8_linear.py`). ``quantize_model(model, "int8" | "int4")`` (weight-only) replaces every
``nn.Linear`` of the model (the merged qkv, o, gate_up and down projections, and an untied LM head) by a
`QuantizedLinear`:

* int8: symmetric, one scale per output channel, ``scale = max|w| / 127``.
* int4: asymmetric groups along the input dimension, 16 levels between the group's min and max
  (``w = q * scale + min``, scale and min in fp16), groups of 128 where ``in_features`` allows it, else
  64 or 32 (SmolLM2's hidden size 576 is 4.5 x 128). Asymmetric because a group's weights are rarely
  centred on 0: spending all 16 levels on ``[min, max]`` halves the step of a symmetric grid that has
  to cover ``[-max|w|, max|w|]``, for 2 more bytes per group.
* A GGUF model whose projection is stored as Q4_1 (blocks of 32 weights with an fp16 scale and min: the
  default model) is that format already: its blocks are loaded as they are (group 32, GGUF's nibble
  order, see `core/models/quant_kernels.py`), never dequantized to 16 bits and quantized again, so int4
  on such a model computes with the file's exact weights.

Tied embeddings (the LM head is the embedding) stay in the model dtype: the embedding is a lookup, not a
matmul. The draft head of speculative decoding reads the LM head's weight, so the head stays dense then.

fp8 KV: `calibrate_kv_scales` runs the model once over calibration tokens with a model-dtype KV cache,
records every KV head's largest |K| and |V|, and sets each attention layer's ``kv_scale`` (see
`kv/attention/fp8.py` for the format and why the scales are static and per head).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from sluice.core.models.errors import ModelLoadError
from sluice.kv.attention import fp8
from sluice.kv.attention.base import AttentionBackend, AttentionMetadata, allocate_kv_cache
from sluice.kv.manager import cdiv
from torch import nn

if TYPE_CHECKING:  # the Triton kernels are imported only where they run (a GPU)
    from sluice.core.models.quant_kernels import GemvTuner

QUANTIZATION_METHODS = ("int8", "int4", "fp8")
INT4_GROUP_SIZES = (128, 64, 32)
Q4_1_GROUP = 32
# no larger than the smallest BLOCK_N of the GEMV configs (quant_kernels.GEMV_CONFIGS): sizes the split-K counters
MIN_GEMV_BLOCK_N = 4


class QuantizedLinear(nn.Module):
    """``y = x @ W^T + bias`` with ``W`` stored as int8 or int4 (formats: `core/models/quant_kernels.py`).

    On a GPU the Triton kernels compute from the packed weights; elsewhere the weight is dequantized
    for each call (the reference path: correct, not fast)."""

    def __init__(
        self,
        bits: int,
        in_features: int,
        out_features: int,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        bias: torch.Tensor | None,
        group_size: int,
        tuner: GemvTuner | None = None,
    ) -> None:
        super().__init__()
        self.bits, self.in_features, self.out_features, self.group_size = bits, in_features, out_features, group_size
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        # split-K GEMV: one arrival counter per output tile, reset by the kernel itself after each use
        n_tiles = cdiv(out_features, MIN_GEMV_BLOCK_N)
        self.register_buffer("counters", torch.zeros(n_tiles, dtype=torch.int32, device=qweight.device))
        self.tuner = tuner

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.bits == 4 else ""
        return f"int{self.bits}, in_features={self.in_features}, out_features={self.out_features}{g}"

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.bits == 4:
            return dequantize_int4(self.qweight, self.scales, self.mins, dtype)
        return dequantize_int8(self.qweight, self.scales, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda":
            return nn.functional.linear(x, self.dequantize(x.dtype), self.bias)
        from sluice.core.models import quant_kernels as qk

        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if self.bits == 4:
            y = qk.int4_matmul(
                x2, self.qweight, self.scales, self.mins, self.group_size, self.bias, self.counters, self.tuner
            )
        else:
            y = qk.int8_matmul(x2, self.qweight, self.scales, self.bias, self.counters, self.tuner)
        return y.reshape(*shape[:-1], self.out_features)


# ------------------------------------------------------------------------------------------- quantizers


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The ``[N, K]`` weight of the int4 format (computed in fp32 as ``q * scale + min``, then cast)."""
    n, groups = scales.shape
    q = unpack_int4(qweight, groups).float()
    w = q * scales.float()[:, :, None] + mins.float()[:, :, None]
    return w.reshape(n, -1).to(dtype)


def unpack_int4(qweight: torch.Tensor, groups: int) -> torch.Tensor:
    """``[N, groups, G]`` uint8 codes 0..15 of the int4 format's ``[N, K/2]`` bytes (in each group of ``G``
    weights the low nibbles are the first half)."""
    b = qweight.view(qweight.shape[0], groups, -1)
    return torch.cat((b & 0xF, b >> 4), dim=-1)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (qweight.float() * scales.float()[:, None]).to(dtype)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (int8 ``q``, float32 per-row scales), symmetric round-to-nearest."""
    w = w.float()
    scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def int4_group_size(in_features: int) -> int:
    for g in INT4_GROUP_SIZES:
        if in_features % g == 0:
            return g
    raise ValueError(f"quantization: int4 needs in_features divisible by 32, got {in_features}")


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (packed uint8 ``[N, K/2]``, fp16 scales, fp16 mins ``[N, K/group]``), asymmetric
    round-to-nearest; ``q`` is computed against the fp16-rounded scale and min, which are what decode uses."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scales = ((hi - lo) / 15.0).to(torch.float16)
    mins = lo.to(torch.float16)
    s = scales.float().clamp_min(1e-12)[:, :, None]
    q = torch.round((wg - mins.float()[:, :, None]) / s).clamp_(0, 15).to(torch.uint8)
    return pack_int4_codes(q), scales, mins


def pack_int4_codes(q: torch.Tensor) -> torch.Tensor:
    """`unpack_int4`'s inverse: uint8 codes 0..15 ``[N, groups, G]`` -> the int4 format's ``[N, K/2]`` bytes."""
    half = q.shape[-1] // 2
    return (q[:, :, :half] | (q[:, :, half:] << 4)).reshape(q.shape[0], -1).contiguous()


# ------------------------------------------------------------------------------------------------ GGUF

# our projection -> GGUF tensor names of its shards (llama.cpp naming), in row order
_GGUF_SHARDS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


class Q4_1Tensors:
    """The Q4_1 projection weights of a GGUF file, as our int4 format (rows in Hugging Face order)."""

    def __init__(self, path: str | Path, config) -> None:
        from gguf import GGMLQuantizationType, GGUFReader

        self.reader = GGUFReader(str(path))
        self.q4_1 = GGMLQuantizationType.Q4_1
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads

    def get(self, layer: int, shard: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(packed, scales, mins) of ``blk.{layer}.{shard}.weight``, or None when it is not Q4_1."""
        t = self.tensors.get(f"blk.{layer}.{shard}.weight")
        if t is None or t.tensor_type != self.q4_1:
            return None
        raw = np.asarray(t.data).reshape(t.data.shape[0], -1, 20)  # [N, K/32, 20]: fp16 d, fp16 m, 16 bytes
        n = raw.shape[0]
        blocks = torch.from_numpy(raw.copy())
        scales = blocks[:, :, 0:2].contiguous().view(torch.float16).reshape(n, -1)
        mins = blocks[:, :, 2:4].contiguous().view(torch.float16).reshape(n, -1)
        packed = blocks[:, :, 4:].reshape(n, -1)
        if shard in ("attn_q", "attn_k"):
            # llama.cpp stores q/k rows permuted for its rope layout; undo it on whole rows
            heads = self.num_heads if shard == "attn_q" else self.num_kv_heads
            perm = torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)
            packed, scales, mins = packed[perm], scales[perm], mins[perm]
        return packed.contiguous(), scales.contiguous(), mins.contiguous()


# ------------------------------------------------------------------------------------------------ model


def quantize_model(
    model: nn.Module,
    method: str,
    gguf_file: str | None = None,
    include_lm_head: bool = True,
    requantize: bool = True,
) -> dict[str, int]:
    """Replace the model's linear layers by `QuantizedLinear` (module doc), or by `Fp8Linear` for ``fp8`` (its
    LM head only where the fp8 recipe asks for it, `core/models/fp8_recipe.py`); returns counts by origin.
    ``requantize=False`` (int4 from a GGUF only): a layer the file holds no Q4_1 blocks for stays dense rather than
    being rounded to int4 here."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: must be one of {QUANTIZATION_METHODS}, got {method!r}")
    if method == "fp8":
        from sluice.core.models.fp8_linear import quantize_model_fp8

        return quantize_model_fp8(model, include_lm_head=include_lm_head)
    from sluice.core.models.quant_kernels import GemvTuner

    gguf = Q4_1Tensors(gguf_file, model.config) if method == "int4" and gguf_file else None
    tuner = GemvTuner()
    counts = {"gguf_q4_1": 0, "quantized": 0}
    targets = [
        name
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and (include_lm_head or not name.endswith("lm_head"))
    ]
    for name in targets:  # one at a time: each dense weight is freed as its replacement goes in
        lin = model.get_submodule(name)
        new = None
        if gguf is not None:
            new = _from_gguf(gguf, name, lin, tuner)
            counts["gguf_q4_1"] += new is not None
        if new is None and not requantize:
            continue
        if new is None:
            new = _quantize_linear(lin, method, tuner)
            counts["quantized"] += 1
        model.set_submodule(name, new)
        del lin
    return counts


def _quantize_linear(lin: nn.Linear, method: str, tuner: GemvTuner) -> QuantizedLinear:
    w = lin.weight.detach()
    n, k = w.shape
    bias = lin.bias.detach() if lin.bias is not None else None
    if method == "int8":
        q, s = quantize_int8(w)
        return QuantizedLinear(8, k, n, q, s, None, bias, k, tuner)
    g = int4_group_size(k)
    packed, s, m = quantize_int4(w, g)
    return QuantizedLinear(4, k, n, packed, s, m, bias, g, tuner)


def _from_gguf(gguf: Q4_1Tensors, name: str, lin: nn.Linear, tuner: GemvTuner) -> QuantizedLinear | None:
    parts = name.split(".")
    if len(parts) < 4 or parts[-4] != "layers":
        return None
    layer, proj = int(parts[-3]), ".".join(parts[-2:])
    shards = _GGUF_SHARDS.get(proj)
    if shards is None:
        return None
    got = [gguf.get(layer, s) for s in shards]
    if any(g is None for g in got):
        return None
    packed, scales, mins = (torch.cat(t, dim=0) for t in zip(*got))
    n, k = lin.weight.shape
    if tuple(packed.shape) != (n, k // 2):
        raise ModelLoadError(f"GGUF Q4_1 weights for {name}: shape {tuple(packed.shape)} != {(n, k // 2)}")
    dev = lin.weight.device
    bias = lin.bias.detach() if lin.bias is not None else None
    return QuantizedLinear(4, k, n, packed.to(dev), scales.to(dev), mins.to(dev), bias, Q4_1_GROUP, tuner)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (the packed weights, scales, norms, embedding, rope tables)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


# ---------------------------------------------------------------------------------------- fp8 KV scales


class _AmaxRecorder(AttentionBackend):
    """Wraps a backend; records each layer's per-head max |K| and |V| as they are written."""

    def __init__(self, inner: AttentionBackend, caches: list[torch.Tensor]) -> None:
        self.inner = inner
        self.layer_of = {c.data_ptr(): i for i, c in enumerate(caches)}
        self.amax = torch.zeros(len(caches), 2, caches[0].shape[3], device=caches[0].device)

    def write_kv(self, key, value, kv_cache, slot_mapping, kv_scale=None) -> None:
        i = self.layer_of[kv_cache.data_ptr()]
        self.amax[i, 0] = torch.maximum(self.amax[i, 0], key.detach().abs().float().amax(dim=(0, 2)))
        self.amax[i, 1] = torch.maximum(self.amax[i, 1], value.detach().abs().float().amax(dim=(0, 2)))
        self.inner.write_kv(key, value, kv_cache, slot_mapping)

    def forward(self, query, kv_cache, meta, scale, kv_scale=None, rope=None, window=0, softcap=0.0):
        assert rope is None  # it must see every key through `write_kv` (`takes_rope` is False)
        return self.inner.forward(query, kv_cache, meta, scale, window=window, softcap=softcap)


@torch.inference_mode()
def calibrate_kv_scales(
    model: nn.Module,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    num_tokens: int = 512,
    seq_len: int = 256,
    seed: int = 0,
    headroom: float = fp8.KV_SCALE_HEADROOM,
) -> torch.Tensor:
    """Set every attention layer's ``kv_scale`` from a forward pass over random token ids (``num_tokens`` in
    sequences of ``seq_len``); returns the scales ``[num_layers, 2, num_kv_heads]``."""
    from sluice.core.models.layers import ForwardContext

    layers = [layer.self_attn for layer in model.model.layers]
    block_size = 16
    seq_len = min(seq_len, num_tokens)
    n_seq = max(1, num_tokens // seq_len)
    nb = cdiv(seq_len, block_size)
    caches = allocate_kv_cache(len(layers), n_seq * nb, block_size, model.num_kv_heads, model.head_dim, dtype, device)
    rec = _AmaxRecorder(backend, caches)
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (n_seq * seq_len,), generator=g).to(device)
    positions = torch.arange(seq_len, device=device).repeat(n_seq)
    slots = torch.arange(n_seq, device=device)[:, None] * nb * block_size + torch.arange(seq_len, device=device)
    qsl = [i * seq_len for i in range(n_seq + 1)]
    meta = AttentionMetadata(
        slot_mapping=slots.reshape(-1),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.full((n_seq,), seq_len, dtype=torch.int32, device=device),
        block_tables=torch.arange(n_seq * nb, dtype=torch.int32, device=device).reshape(n_seq, nb),
        max_query_len=seq_len,
        max_seq_len=seq_len,
        query_start_loc_host=qsl,
        seq_lens_host=[seq_len] * n_seq,
    )
    for layer in layers:
        layer.kv_scale = None
    model(ids, positions, ForwardContext(meta, caches, rec))
    scales = fp8.scales_from_amax(rec.amax, headroom)
    for i, layer in enumerate(layers):
        layer.kv_scale = scales[i].contiguous()
    return scales
