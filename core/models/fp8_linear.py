"""FP8 (e4m3) W8A8 linear layers: ``--quantization fp8``.

Format: ``qweight`` ``float8_e4m3fn [N, K]`` and ``weight_scale`` float32 ``[N]`` (one per output channel),
``W[n, k] = qweight[n, k] * weight_scale[n]``. Quantized online at load (`quantize_weight`): ``scale = amax / 448``
over the row by default (`core/models/fp8_scales.py` has the ``mse`` alternative), an all-zero row gets scale 1,
non-finite weights saturate instead of poisoning their row's scale.
A Hugging Face FP8 checkpoint brings its own codes and scales (`core/models/fp8_checkpoint.py`).

Activations are quantized per token (per row of ``x``) when the layer runs: ``s_x = amax(|x_row|) / 448`` with
amax clamped to ``[MIN_AMAX, float32 max]``, so a row of zeros, a row of tiny values or an infinite value never
produce 0/0 or inf/inf (`quantize_rows`). The product is ``(q_x @ q_w^T) * s_x[:, None] * s_w[None, :] + bias``,
accumulated in fp32. Per token (not per tensor) because a batch mixes tokens whose magnitudes differ by orders of
magnitude (the first token of a sequence, an attention sink, is the classic outlier): one scale for all would push
the small tokens into e4m3's subnormals.

On a GPU (`core/models/fp8_kernels.py`): up to `fp8_kernels.gemv_rows` rows (decode at small batch, weight-read
bound) one Triton kernel quantizes ``x`` itself and streams the fp8 weight once; more rows quantize ``x`` in a small
Triton kernel and multiply through ``torch._scaled_mm`` (Hopper's fp8 tensor cores, row-wise scales). Elsewhere
the same numerics are emulated in torch (`fp8_linear_reference`): ``x`` rounded to e4m3 and back, times the
dequantized weight in fp32; so CPU tests and the CPU perplexity bench measure the real quantization error.

What is made fp8 is `core/models/fp8_recipe.py`'s: every linear layer but the last decoder layer's (why there).
The LM head and the embedding stay in the model's dtype: the embedding is a lookup, not a matmul, and the head's
logits are what sampling sees directly (a relative error of a few 1e-3 per logit moves greedy picks at near-ties
with nothing after it to average the error out); its weight is ~6% of an 8B model's bytes (the recipe's
``lm_head``, ``SLUICE_FP8_LM_HEAD=1``, makes it fp8 too).
"""

from __future__ import annotations

import torch
from sluice.core.models import fp8_recipe
from sluice.core.models.fp8_format import F32_MAX, MIN_AMAX, MIN_BLOCK_N
from sluice.core.models.fp8_recipe import Fp8Recipe
from sluice.core.models.fp8_scales import Reduce, weight_scales
from sluice.kv.attention.fp8 import FP8_DTYPE, FP8_MAX
from torch import nn


def sanitize(w: torch.Tensor) -> torch.Tensor:
    """``w`` in fp32 with NaN as 0 and +-inf as the largest finite value of ``w``'s dtype."""
    big = float(torch.finfo(w.dtype).max) if w.dtype.is_floating_point else F32_MAX
    return torch.nan_to_num(w.float(), nan=0.0, posinf=big, neginf=-big)


def quantize_weight(
    w: torch.Tensor, rule: str = "max", reduce: Reduce | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (e4m3 codes, float32 per-row scales): scales by ``rule`` (`fp8_scales`: ``max`` or ``mse``),
    codes ``round(w / scale)`` saturated at +-448. ``reduce``: how a row-parallel shard under tensor parallelism
    combines its rows' statistics with the other ranks' (`fp8_scales.weight_scales`), so every rank's scales are
    the single process's."""
    wf = sanitize(w)
    scales = weight_scales(wf, rule, reduce)
    q = (wf / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales


def dequantize_weight(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scales.float()[:, None]).to(dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (e4m3 codes, float32 scales ``[M]``), one scale per row (token): the torch reference of
    `fp8_kernels.quantize_rows` (module doc for the clamps)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1).clamp(MIN_AMAX, F32_MAX)
    q = (xf * (FP8_MAX / amax)[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, amax / FP8_MAX


def fp8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The W8A8 product in torch (fp32 accumulation), in ``x``'s dtype: the CPU path and the GPU kernels'
    reference."""
    shape = x.shape
    xq, sx = quantize_rows(x.reshape(-1, shape[-1]))
    y = (xq.float() @ qweight.float().t()) * sx[:, None] * weight_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], qweight.shape[0])


class Fp8Linear(nn.Module):
    """``y = x @ W^T + bias`` with ``W`` in e4m3 and a scale per output channel, ``x`` quantized per token.
    ``weight_scale_rule``: how the scales were chosen at load (`fp8_scales`), None for a checkpoint's own."""

    def __init__(
        self,
        qweight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        weight_scale_rule: str | None = None,
    ) -> None:
        super().__init__()
        self.weight_scale_rule = weight_scale_rule
        assert qweight.dtype == FP8_DTYPE and weight_scale.shape == (qweight.shape[0],)
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("weight_scale", weight_scale.float().contiguous())
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        # the GEMV's split-K arrival counters, one per smallest output tile (reset by the kernel after use)
        n_tiles = -(-self.out_features // MIN_BLOCK_N)
        self.register_buffer("counters", torch.zeros(n_tiles, dtype=torch.int32, device=qweight.device))

    @classmethod
    def from_linear(cls, lin: nn.Linear, rule: str = "max", reduce: Reduce | None = None) -> Fp8Linear:
        q, s = quantize_weight(lin.weight.detach(), rule, reduce)
        return cls(q, s, lin.bias.detach() if lin.bias is not None else None, rule)

    def extra_repr(self) -> str:
        scales = self.weight_scale_rule or "checkpoint"
        return f"fp8 e4m3, in_features={self.in_features}, out_features={self.out_features}, scales={scales}"

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_weight(self.qweight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda":
            return fp8_linear_reference(x, self.qweight, self.weight_scale, self.bias)
        from sluice.core.models import fp8_kernels

        return fp8_kernels.fp8_linear(x, self.qweight, self.weight_scale, self.bias, self.counters)


# ------------------------------------------------------------------------------------------------ model

# Row-parallel projections under tensor parallelism: a rank holds some input columns of every output row.
ROW_PARALLEL = ("o_proj", "down_proj")


def quantize_model_fp8(model: nn.Module, include_lm_head: bool = False, recipe: Fp8Recipe | None = None) -> dict:
    """Replace the model's ``nn.Linear`` layers (the LM head where ``recipe`` asks for it and ``include_lm_head``
    allows it, i.e. no draft head reads it; from the embedding table where the head is tied to it: module doc) but
    the ones ``recipe`` keeps dense (`fp8_recipe`; None: the process's) by `Fp8Linear` with the recipe's weight
    scales, one at a time (each dense weight is freed as its replacement goes in). Under tensor parallelism
    (``model.tp``) a column-parallel shard holds whole rows, so its scales are the single process's; a row-parallel
    one (o, down) holds part of each row, and its rows' statistics are combined over every rank's part (all-reduces
    at load), so its scales are too; a tied head's table is sharded by vocabulary rows, so its copy is too. Returns
    counts."""
    tp = getattr(model, "tp", None)
    recipe = recipe or fp8_recipe.recipe()
    include_lm_head = include_lm_head and recipe.lm_head
    linears = [
        name
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and (include_lm_head or not name.endswith("lm_head"))
    ]
    targets = recipe.fp8_targets(linears)
    for name in targets:
        lin = model.get_submodule(name)
        parent, _, attr = name.rpartition(".")
        reduce = across_ranks(tp) if tp is not None and attr in ROW_PARALLEL else None
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, Fp8Linear.from_linear(lin, recipe.weight_scale, reduce))
        del lin
    tied = include_lm_head and getattr(model, "lm_head", False) is None  # the head is the embedding table
    if tied:  # an fp8 copy of the table for the head (lookups keep the table), as `cpu_linear.quantize_tied_head`
        q, s = quantize_weight(model.model.embed_tokens.weight.detach(), recipe.weight_scale)
        model.lm_head = Fp8Linear(q, s, None, recipe.weight_scale)
    return {"fp8": len(targets) + tied, "dense": len(linears) - len(targets)}


def across_ranks(tp) -> Reduce:
    """`fp8_scales.Reduce` over the ranks of ``tp`` (a `parallel.TensorParallel`): an all-reduce in place."""
    import torch.distributed as dist

    ops = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}

    def reduce(t: torch.Tensor, op: str) -> None:
        dist.all_reduce(t, op=ops[op], group=tp.group)

    return reduce
