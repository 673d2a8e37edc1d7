"""Weight-only quantized linear layers prepacked for the CPU's own kernels, chosen per machine at load.

`QuantizedLinear` (`core/models/quant.py`) off the GPU dequantizes its whole weight at every call: correct, and
the reference, but a decode step then reads and writes the dense weight of every projection (a 135M model's step
was ~42 ms in bf16 on two cores, most of it there). torch ships CPU matmuls that read packed weights directly:

* ``int4pack``: ``aten._weight_int4pack_mm_for_cpu``, int4 groups along the input dimension, each weight
  ``(q - 8) * scale + zero``. Our int4 format (and GGUF's Q4_1) is ``q * scale + min``, the same affine map with
  ``zero = min + 8 * scale``: a repack, not a requantization. The kernel takes bf16 activations and bf16
  ``scale`` / ``zero`` (fp16 and fp32 inputs run a scalar path ~30x slower), so the fp16 scale and min of the
  file are rounded to bf16 once at load: weights within a bf16 rounding of the file's (what a bf16 model has anyway).
* ``int8pack``: ``aten._weight_int8pack_mm``, int8 weights with one scale per output channel, our int8 format
  exactly (the scale rounded to bf16).

Both are vectorized for AVX2 and AVX-512 (`select_cpu_kernel`); elsewhere, and for fp32 models (whose int4
path must stay exactly the file's weights in fp32), the layer keeps the reference path. Both kernels are made for
few rows (decode); calls of many rows (prefill chunks, batched decode) run a bf16 GEMM on a dense weight instead:
`Int4PackedLinear` keeps a bf16 copy of its weight for them (2.5 bytes a weight in all), a tied head multiplies
the embedding table it was quantized from.

A tied LM head (the embedding, SmolLM2's: 49152 x 576, a fifth of the model) is the largest single matmul of a
decode step; left in bf16 it reads 57 MB a token, as much as every packed projection together. `quantize_tied_head`
gives it an int8 copy (per-row scales, `int8pack`) for calls of a few rows: the GGUF stores that embedding as
Q8_0 (int8 in blocks of 32), so int8 rows are the precision the file itself chose for it (an int4 head, twice as
fast again, moved the default model's perplexity by several percent); the embedding lookup keeps the dense table.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from sluice.core.models.quant import QuantizedLinear, quantize_int4, quantize_int8, unpack_int4
from torch import nn

logger = logging.getLogger("sluice")

# ISAs (torch.backends.cpu.get_cpu_capability()) whose packed int4/int8 matmuls are vectorized
PACKED_ISAS = ("AVX2", "AVX512")

# Groups of the int4 weights rounded here from dense ones (`Int4PackedLinear.rounded_from`): the smallest torch's
# packing takes, the GGUF's Q4_1 block. The shipped draft head rounded in groups of 64 and 128 (`quant.quantize_model`'s
# choice) proposed drafts of ~0.2 less mean acceptance length on the CPU benchmark's prompts than in groups of 32.
ROUNDED_GROUP_SIZE = 32

# torch's packed CPU matmuls have no public names yet
_aten = torch.ops.aten
pack_int4 = _aten._convert_weight_to_int4pack_for_cpu  # noqa: SLF001
int4pack_mm = _aten._weight_int4pack_mm_for_cpu  # noqa: SLF001
int8pack_mm = _aten._weight_int8pack_mm  # noqa: SLF001


def cpu_capability() -> str:
    """The vector ISA torch's CPU kernels dispatch to on this machine: "AVX512", "AVX2", "DEFAULT", ... ."""
    return torch.backends.cpu.get_cpu_capability()


def select_cpu_kernel(bits: int, dtype: torch.dtype, isa: str) -> str:
    """The kernel a weight-only ``bits``-bit linear layer runs on this CPU for ``dtype`` activations:
    ``int4pack`` / ``int8pack`` (prepacked, bf16 activations, an AVX2 or AVX-512 machine), else ``dequantize``
    (the reference: the weight dequantized at each call)."""
    if dtype != torch.bfloat16 or isa not in PACKED_ISAS or bits not in (4, 8):
        return "dequantize"
    return f"int{bits}pack"


class Int4PackedLinear(nn.Module):
    """``y = x @ W^T + bias`` with ``W`` in torch's CPU int4 packing (groups of ``group_size`` along K).

    The packed kernel is a GEMV at heart: at a few rows (decode) it reads a quarter of bf16's bytes and wins, but
    its time grows with the rows, and from a dozen or so rows on (prefill chunks, batched decode) oneDNN's bf16
    GEMM on a dense weight is faster, several times so at 64 rows and more. From `DENSE_MIN_ROWS` rows the layer
    multiplies a dense bf16 copy of the weight made at load: the packed kernel's own weight
    (``(q - 8) * scale + zero`` with the same bf16 scale and zero) rounded to bf16, the rounding a bf16 model's
    weights have (the packed kernel keeps them in fp32), so the two paths agree within bf16 rounding, not bit for
    bit. The copy costs 2 bytes a weight beside the packed half byte; dequantizing it at each call instead cost
    more than the GEMM it fed at batched-decode sizes (several passes over the weight per projection, 30 layers)."""

    DENSE_MIN_ROWS = 16

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group_size: int,
        bias,
        dense: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features, self.group_size = qweight.shape[0], qweight.shape[1] * 2, group_size
        q = unpack_int4(qweight, scales.shape[1]).view(qweight.shape[0], -1)
        self.register_buffer("packed", pack_int4(q.to(torch.int32), 2))  # (inner k tiles: unused on the CPU)
        s, z = scales.to(torch.bfloat16), zeros.to(torch.bfloat16)  # [N, K / group]
        self.register_buffer("scales_and_zeros", torch.stack((s.t(), z.t()), dim=-1).contiguous())  # [K/g, N, 2]
        if dense is not None:  # the weight this was rounded from, the owner's: shared, not a buffer
            self.dense = dense.detach()
        else:  # (q - 8) * s + z == q * s + (z - 8 s), exact in fp32 (s and z are bf16), then rounded to bf16 once
            q = q.view(self.out_features, -1, group_size).float()
            dense = torch.addcmul((z.float() - 8 * s.float())[..., None], q, s.float()[..., None])
            self.register_buffer("dense", dense.view(self.out_features, -1).to(torch.bfloat16))
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def from_int4(cls, qweight, scales, mins, bias, group_size: int, dense=None) -> Int4PackedLinear:
        """From our int4 format (`quant.quantize_int4`: ``[N, K/2]`` uint8, low nibbles the first half of each
        group; fp16 ``scale`` and ``min`` ``[N, K / group]``)."""
        s = scales.float()
        return cls(qweight, s, mins.float() + 8 * s, group_size, bias, dense)  # (q - 8) * s + zero == q * s + min

    @classmethod
    def rounded_from(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int4PackedLinear:
        """``weight`` (bf16 ``[N, K]``) rounded to int4 (`quant.quantize_int4`, groups of `ROUNDED_GROUP_SIZE`) for
        the few-row calls; calls of many rows multiply ``weight`` itself, shared, not copied. For products whose
        precision costs only speed, never correctness: a draft head's, whose drafts the target verifies."""
        g = ROUNDED_GROUP_SIZE
        return cls.from_int4(*quantize_int4(weight, g), bias, g, dense=weight)

    def extra_repr(self) -> str:
        return f"int4pack, in_features={self.in_features}, out_features={self.out_features}, group={self.group_size}"

    def dense_weight(self) -> torch.Tensor:
        """``[N, K]`` bf16: the many-row path's weight (the packed kernel's rounded to bf16, or the one shared)."""
        return self.dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] >= self.DENSE_MIN_ROWS:
            y = F.linear(x2, self.dense, self.bias)
        else:
            y = int4pack_mm(x2, self.packed, self.group_size, self.scales_and_zeros)
            if self.bias is not None:
                y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Int8PackedLinear(nn.Module):
    """``y = (x @ Q^T) * scale + bias`` with int8 ``Q`` ``[N, K]`` and one bf16 scale per output channel.

    With ``dense`` (a bf16 ``[N, K]`` weight the model holds anyway: a tied head's embedding table, shared, not
    copied) calls of `DENSE_MIN_ROWS` rows or more multiply it instead: the int8 kernel's time grows with the rows
    (a GEMV per row), and the head's 49152 columns made it a large part of a batched decode step."""

    DENSE_MIN_ROWS = 8

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias, dense: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.to(torch.bfloat16).contiguous())
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.dense = dense.detach() if dense is not None else None  # not a buffer: the owner's tensor, shared

    def extra_repr(self) -> str:
        dense = f", dense from {self.DENSE_MIN_ROWS} rows" if self.dense is not None else ""
        return f"int8pack, in_features={self.in_features}, out_features={self.out_features}{dense}"

    def forward_one_row(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` of one row ``[1, K]`` as a plain reduction over K, for a compiler to turn into one vectorized
        pass over the int8 weight: at one thread it beats the packed kernel, whose time there is not its bytes
        (`core/worker/cpu_compiled.py` times both and keeps the faster)."""
        y = (x.reshape(1, -1).float() * self.qweight.float()).sum(-1) * self.scales.float()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).view(1, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.dense is not None and x2.shape[0] >= self.DENSE_MIN_ROWS:
            return F.linear(x2, self.dense, self.bias).view(*x.shape[:-1], self.out_features)
        y = int8pack_mm(x2, self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def round_linears_to_int4(module: nn.Module) -> int:
    """Replace every ``nn.Linear`` of a bf16 ``module`` by an `Int4PackedLinear` rounded from its weight
    (`Int4PackedLinear.rounded_from`: only where rounding costs no correctness); returns how many."""
    linears = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    for name, lin in linears:
        bias = lin.bias.detach() if lin.bias is not None else None
        module.set_submodule(name, Int4PackedLinear.rounded_from(lin.weight.detach(), bias))
    return len(linears)


def packed_kernels_available(isa: str | None = None) -> bool:
    """Whether this CPU runs the packed int4 matmul vectorized (what `--quantization auto` resolves to int4 for)."""
    return select_cpu_kernel(4, torch.bfloat16, cpu_capability() if isa is None else isa) == "int4pack"


def quantize_tied_head(model: nn.Module, dtype: torch.dtype, isa: str | None = None) -> bool:
    """Give a model whose LM head is its embedding (``lm_head`` None) an `Int8PackedLinear` head quantized from
    the embedding (module doc), where this CPU packs int8 for ``dtype``; returns whether it did."""
    isa = cpu_capability() if isa is None else isa
    if getattr(model, "lm_head", False) is not None or select_cpu_kernel(8, dtype, isa) != "int8pack":
        return False
    table = model.model.embed_tokens.weight.detach()
    q, scales = quantize_int8(table)
    model.lm_head = Int8PackedLinear(q, scales, None, dense=table if table.dtype == torch.bfloat16 else None)
    return True


def pack_for_cpu(model: nn.Module, dtype: torch.dtype, isa: str | None = None) -> dict[str, int]:
    """Replace each `QuantizedLinear` of a CPU model by its packed form where `select_cpu_kernel` picks one, and
    quantize a tied LM head (`quantize_tied_head`); returns the layer counts by kernel (logged: which kernel runs)."""
    isa = cpu_capability() if isa is None else isa
    counts: dict[str, int] = {}
    targets = [name for name, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    for name in targets:
        lin = model.get_submodule(name)
        kernel = select_cpu_kernel(lin.bits, dtype, isa)
        counts[kernel] = counts.get(kernel, 0) + 1
        if kernel == "dequantize":
            continue
        bias = lin.bias.detach().to(dtype) if lin.bias is not None else None
        if kernel == "int4pack":
            new = Int4PackedLinear.from_int4(lin.qweight, lin.scales, lin.mins, bias, lin.group_size)
        else:
            new = Int8PackedLinear(lin.qweight, lin.scales, bias)
        model.set_submodule(name, new)
    if quantize_tied_head(model, dtype, isa):
        counts["int8pack (tied LM head)"] = 1
    if counts:
        logger.info("CPU linear kernels (%s, %s activations): %s", isa, str(dtype).removeprefix("torch."), counts)
    return counts
