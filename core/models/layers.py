"""Building blocks shared by the model families; all run on a flattened token batch ``[num_tokens, ...]``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from sluice.kv.attention.base import AttentionBackend, AttentionMetadata
from torch import nn


@dataclass(slots=True)
class ForwardContext:
    """What attention layers need besides activations: where the KV lives and how to read it."""

    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]
    backend: AttentionBackend


class Linear(nn.Linear):
    """``nn.Linear`` whose few-row products (decode steps at small batch) may run the Triton GEMV of
    `core/models/gemv.py` (set by `enable_fused_kernels`); larger ones, and the CPU, stay with ``F.linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias)
        self.fused = None
        self.counters: torch.Tensor | None = None  # the GEMV's split-K arrival counters (not a parameter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(x, self.weight, self.bias, self.counters)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused = None  # a kernel of core/models/fused.py, set by `enable_fused_kernels`

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With ``residual``: returns ``(norm(x + residual), x + residual)`` (the pre-norm residual stream)."""
        if self.fused is not None:
            out, res = self.fused(x, residual, self.weight, self.eps)
            return out if residual is None else (out, res)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


def norm_then_linear(
    norm: RMSNorm,
    linear: nn.Module,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    act: SiluAndMul | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(h), residual)`` for ``h, residual = norm(x, residual)`` (``norm(x)`` and ``x`` without a residual):
    a decoder layer's norm and the projection after it; with ``act``, ``(act(linear(h)), residual)`` (the MLP's
    gate/up projection and its SiLU-and-mul). For a few rows, when they run fused kernels, the norm is folded into
    the GEMV (`gemv.gemv_rmsnorm`) and the SiLU-and-mul into its epilogue (`gemv.gemv_silu`); otherwise each runs
    on its own."""
    from sluice.core.models import gemv

    rows = _fold_rows(norm, linear, x, gemv.fold_norm_rows)
    if rows:
        gated = act is not None and bool(_fold_rows(act, linear, x, gemv.fold_silu_rows))
        x2 = x.reshape(rows, x.shape[-1]).contiguous()
        r2 = residual.reshape(rows, x.shape[-1]).contiguous() if residual is not None else None
        out, res = gemv.gemv_rmsnorm(
            x2, r2, norm.weight, norm.eps, linear.weight, linear.bias, linear.counters, silu=gated
        )
        out = out.view(*x.shape[:-1], out.shape[-1])
        return (act(out) if act is not None and not gated else out), res.view(x.shape)
    if residual is None:
        h, residual = norm(x), x
    else:
        h, residual = norm(x, residual)
    return (linear(h) if act is None else linear_then_act(linear, act, h)), residual


def linear_then_act(linear: nn.Module, act: SiluAndMul, x: torch.Tensor) -> torch.Tensor:
    """``act(linear(x))``: the MLP's gate/up projection and SiLU-and-mul; for a few rows, when both run fused
    kernels, one GEMV that applies the SiLU-and-mul to its gate and up tiles in its epilogue (`gemv.gemv_silu`)."""
    from sluice.core.models import gemv

    rows = _fold_rows(act, linear, x, gemv.fold_silu_rows)
    if rows:
        out = gemv.gemv_silu(x.reshape(rows, x.shape[-1]).contiguous(), linear.weight, linear.bias, linear.counters)
        return out.view(*x.shape[:-1], out.shape[-1])
    return act(linear(x))


def _fold_rows(before: nn.Module, linear: nn.Module, x: torch.Tensor, limit: Callable[[], int]) -> int:
    """The rows of ``x`` (``linear``'s input) when the kernel of ``before`` (the norm before it, the SiLU-and-mul
    after it) can be folded into ``linear``'s GEMV: both run fused kernels, the GEMV serves this many rows, and no
    more than ``limit()``; else 0. ``limit`` is called only for a GEMV layer (a GPU's): the CPU's compiled step
    traces this function, and torch.compile warns at every cached function it meets."""
    from sluice.core.models import gemv

    rows = x.numel() // x.shape[-1]
    foldable = getattr(linear, "fused", None) is gemv.linear and before.fused is not None
    if foldable and 0 < rows <= min(limit(), gemv.max_rows()) and x.dtype == linear.weight.dtype:
        return rows
    return 0


class HeadNorms:
    """An attention layer that norms each head of q and k (Qwen3's ``q_norm`` and ``k_norm``) before RoPE:
    `enable_fused_kernels` gives it ``fused_qk_norm`` (`fused.rmsnorm_qk_`, both norms in one launch over the qkv
    rows); None keeps its two norm modules, whatever kernels they run."""

    fused_qk_norm: Callable | None = None


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fused = None

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a precomputed cos/sin table indexed by position.

    The inverse frequencies come from transformers' own rope functions, so every rope type its
    configs name (llama3 scaling, linear, yarn, ...) means here what it means there. ``layer_type`` picks one
    of a config's per-layer-type RoPE parameters (Gemma 3's ``sliding_attention`` / ``full_attention``).

    LongRoPE (Phi-3) has two sets of frequencies, short for sequences within the pretrained length
    (``original_max_position_embeddings``) and long beyond it; transformers switches the whole sequence when it
    grows past that length. Here the table holds the short frequencies for positions within it and the long ones
    beyond, so a position always rotates the same way (a batch's tokens do not depend on their neighbours, and
    a cached key never needs rotating again): exactly transformers' answer for sequences within the pretrained
    length, the long factors' rotation for every position past it.
    """

    def __init__(self, config, head_dim: int, max_position: int, layer_type: str | None = None) -> None:
        super().__init__()
        if layer_type is None and "full_attention" in (getattr(config, "rope_parameters", None) or {}):
            layer_type = "full_attention"  # parameters per layer type (Gemma 3): the global layers'
        params = rope_parameters(config, layer_type)
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"unsupported rope_type {rope_type!r}")
            kw = {"layer_type": layer_type} if layer_type is not None else {}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kw)
        t = torch.arange(max_position, dtype=torch.float)
        freqs = torch.outer(t, inv_freq.float())
        if rope_type == "longrope" and max_position > params["original_max_position_embeddings"]:
            beyond = params["original_max_position_embeddings"]
            long_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=beyond + 1, **kw)
            freqs[beyond:] = torch.outer(t[beyond:], long_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        self.fused = None
        # the rotation and the KV write in one kernel (`fused.rope_and_write_kv_`), set by `enable_fused_kernels`
        # (``fused_rope_kv=False``: two kernels, for side-by-side timing)
        self.fused_write = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q ``[T, Hq, D]``, k ``[T, Hk, D]``; rotated in the input dtype, as transformers does.
        The fused path rotates q and k in place (they are views of the qkv projection's output)."""
        if self.fused is not None:
            self.fused(positions, q, k, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def enable_fused_kernels(
    model: nn.Module, gemv: bool = True, fused_rope_kv: bool = True, moe_decode: bool | None = None
) -> int:
    """Switch every norm, activation and rotary module of ``model`` to the fused Triton kernels where the
    shapes allow (rotary needs ``head_dim / 2`` a power of two), and its 16-bit linear layers to the few-row
    GEMV; returns how many modules switched. ``gemv=False`` keeps cuBLAS for every linear layer,
    ``fused_rope_kv=False`` RoPE and the KV write in two kernels, ``moe_decode`` a mixture-of-experts layer's
    calls of a few tokens through `core/models/moe_decode.py` (True: every layer, False: none, None: the layers that
    prefer it, `SparseMoeBlock.decode_preferred`) (switches for side-by-side timing: the engine sets them
    from ``SLUICE_GEMV``, ``SLUICE_FUSED_ROPE_KV`` and ``SLUICE_MOE_DECODE``, `core/envs.py`)."""
    from sluice.core.models import fused
    from sluice.core.models import gemv as gemv_kernels
    from sluice.core.models.moe import SparseMoeBlock

    kernels = {
        RMSNorm: fused.add_rmsnorm,
        SiluAndMul: fused.silu_and_mul,
        RotaryEmbedding: fused.rope_,
        Linear: gemv_kernels.linear,
    }
    n = 0
    for m in model.modules():
        if isinstance(m, HeadNorms):
            m.fused_qk_norm = fused.rmsnorm_qk_
            n += 1
        if isinstance(m, SparseMoeBlock) and (m.decode_preferred() if moe_decode is None else moe_decode):
            m.enable_decode_kernels()
            n += 1
        kernel = kernels.get(type(m))
        if kernel is None:
            continue
        if isinstance(m, RotaryEmbedding):
            half = m.cos.shape[-1] // 2
            if half & (half - 1):
                continue
            if fused_rope_kv:
                m.fused_write = fused.rope_and_write_kv_
        if isinstance(m, Linear):
            if m.weight.dtype not in (torch.float16, torch.bfloat16) or not gemv:
                continue
            if m.weight.numel() * m.weight.element_size() < gemv_kernels.MIN_WEIGHT_BYTES:
                continue
            tiles = -(-m.out_features // gemv_kernels.MIN_BLOCK_N)
            m.counters = torch.zeros(tiles, dtype=torch.int32, device=m.weight.device)
        m.fused = kernel
        n += 1
    return n


def enable_cpu_kernels(model: nn.Module) -> int:
    """Switch every norm, activation and rotary module of a CPU model to the implementations of
    `core/models/cpu_kernels.py` (the same arithmetic in a few torch calls); returns how many modules switched."""
    from sluice.core.models import cpu_kernels

    kernels = {RMSNorm: cpu_kernels.add_rmsnorm, SiluAndMul: cpu_kernels.silu_and_mul}
    n = 0
    for m in model.modules():
        if type(m) is RotaryEmbedding:
            m.fused = cpu_kernels.Rope()  # holds its own tables cast to the activation dtype
        elif type(m) in kernels:
            m.fused = kernels[type(m)]
        else:
            continue
        n += 1
    return n


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value (the first of equals; a NaN counts as largest), as ``argmax``: by
    ``max``'s indices, whose CPU kernel is vectorized for bf16 where ``argmax``'s is not."""
    return logits.max(dim=-1).indices


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def sliding_window_of(config, layer_idx: int) -> int:
    """How many keys (the query's own included) a query of layer ``layer_idx`` sees; 0 = all. A config's
    ``layer_types`` names each layer's kind (Gemma 2/3, and Qwen2/3 with ``use_sliding_window`` off: all full);
    without them, ``sliding_window`` is every layer's (Mistral, Phi-3), unless ``use_sliding_window`` says off."""
    window = int(getattr(config, "sliding_window", None) or 0)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return window if layer_types[layer_idx] == "sliding_attention" else 0
    if getattr(config, "use_sliding_window", None) is False:
        return 0
    return window


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """A config's RoPE parameters (``rope_type``, ``rope_theta``, scaling), those of ``layer_type`` where they differ
    per layer type; transformers 4.x configs (``rope_scaling``, ``rope_theta``) read the same way."""
    params = getattr(config, "rope_parameters", None)
    if params and layer_type is not None and layer_type in params:
        return dict(params[layer_type])
    if params:
        return dict(params)
    # transformers 4.x configs
    out = dict(getattr(config, "rope_scaling", None) or {})
    if "type" in out and "rope_type" not in out:
        out["rope_type"] = out.pop("type")
    out.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return out
