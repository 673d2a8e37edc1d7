"""Hugging Face FP8 checkpoints (``config.quantization_config`` with ``quant_method: "fp8"``), loaded as they are.

Such a checkpoint stores a quantized linear layer's weight as ``float8_e4m3fn`` codes with its scale beside it:
``<layer>.weight_scale`` (or ``weight_scale_inv``, transformers' FineGrainedFP8 name; both multiply the codes), per
tensor (one value) or per output channel (``[N]`` or ``[N, 1]``). Block-wise scales (``weight_block_size``, or a
scale of ``[N / b, K / b]``) are refused with an error. ``input_scale`` (static activation scales) is dropped:
activations are quantized per token when the layer runs (`core/models/fp8_linear.py`).

Loading: the codes enter the model's dense parameters through the model's own loader (merged projections,
tensor-parallel shards), cast to the model's dtype, which holds every e4m3 value exactly; the scales are kept
aside. Then every linear layer that received codes becomes an `Fp8Linear` of those codes (cast back: exact) and a
scale per row, a merged projection's rows taking their part's scale (q/k/v, gate/up). The model computes with the
file's own weights, not with a second rounding of them. Under tensor parallelism per-tensor scales and row-parallel
layers' per-channel scales (whole rows on every rank) are supported; per-channel scales of a column-parallel layer
are refused (the rank's rows of them are not mapped yet).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from sluice.core.models.errors import ModelLoadError
from sluice.core.models.fp8_linear import ROW_PARALLEL, Fp8Linear
from sluice.kv.attention.fp8 import FP8_DTYPE
from torch import nn

SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
# our merged projections -> the checkpoint layers they hold, in row order
MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fp8_quantization_config(config) -> dict | None:
    """The checkpoint's FP8 ``quantization_config`` (None when it is not an FP8 checkpoint); block-wise refused."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    if qc.get("quant_method") != "fp8":
        return None
    if qc.get("weight_block_size"):
        raise ModelLoadError(
            f"FP8 checkpoint with block-wise scales (weight_block_size {qc['weight_block_size']}) is not supported; "
            "per-tensor and per-channel scales are"
        )
    return qc


class Fp8Checkpoint:
    """`wrap` the checkpoint's tensors on their way into the model, then `apply` to the loaded model."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.scales: dict[str, torch.Tensor] = {}  # checkpoint layer -> fp32 scale, [1] or [N]
        self.coded: set[str] = set()  # checkpoint layers whose weight came as e4m3 codes

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> Fp8Checkpoint | None:
        return cls(dtype) if fp8_quantization_config(config) is not None else None

    def wrap(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors for the model's loader: codes cast to the model's dtype (exact), scales taken aside."""
        for name, t in weights:
            if name.endswith(".input_scale"):
                continue
            suffix = next((s for s in SCALE_SUFFIXES if name.endswith(s)), None)
            if suffix is not None:
                self.scales[name[: -len(suffix)]] = scale_vector(name, t)
                continue
            if t.dtype == FP8_DTYPE and name.endswith(".weight"):
                self.coded.add(name[: -len(".weight")])
                t = t.to(self.dtype)
            yield name, t

    def apply(self, model: nn.Module) -> int:
        """Make every linear layer that received codes an `Fp8Linear`; returns how many."""
        unscaled = sorted(self.coded - set(self.scales))
        if unscaled:
            raise ModelLoadError(f"FP8 weights without a weight_scale: {', '.join(unscaled[:4])}")
        done: set[str] = set()
        for name, mod in list(model.named_modules()):
            if not isinstance(mod, nn.Linear):
                continue
            parent, _, attr = name.rpartition(".")
            parts = [f"{parent}.{p}" if parent else p for p in MERGED.get(attr, (attr,))]
            coded = [p in self.coded for p in parts]
            if not any(coded):
                continue
            if not all(coded):
                raise ModelLoadError(f"{name}: its parts {parts} are not all FP8")
            owner = model.get_submodule(parent) if parent else model
            sizes = owner.shard_sizes if attr in MERGED else (mod.out_features,)
            whole_rows = getattr(model, "tp", None) is None or attr in ROW_PARALLEL
            scale = torch.cat([self._row_scales(p, n, whole_rows) for p, n in zip(parts, sizes)])
            bias = mod.bias.detach() if mod.bias is not None else None
            q = mod.weight.detach().to(FP8_DTYPE)
            setattr(owner, attr, Fp8Linear(q, scale.to(q.device), bias))
            done.update(parts)
        stray = sorted(self.coded - done)
        if stray:
            raise ModelLoadError(f"FP8 weights on layers that are not linear: {', '.join(stray[:4])}")
        return len(done)

    def _row_scales(self, part: str, rows: int, whole_rows: bool) -> torch.Tensor:
        s = self.scales[part]
        if s.numel() == 1:
            return s.expand(rows)
        if not whole_rows:
            raise ModelLoadError(
                f"{part}: per-channel FP8 scales of a column-parallel layer under tensor parallelism are not supported"
            )
        if s.numel() != rows:
            raise ModelLoadError(f"{part}: {s.numel()} FP8 scales for {rows} rows")
        return s


def scale_vector(name: str, t: torch.Tensor) -> torch.Tensor:
    """A checkpoint scale as fp32 ``[1]`` (per tensor) or ``[N]`` (per channel); block-wise and non-finite or
    negative scales refused."""
    if t.dim() == 2 and t.shape[1] != 1:
        raise ModelLoadError(f"{name}: block-wise FP8 scales {tuple(t.shape)} are not supported")
    s = t.float().reshape(-1)
    if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
        raise ModelLoadError(f"{name}: FP8 scales must be finite and >= 0")
    return s
