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

Both are vectorized for AVX2 and AVX-512, but they convert every weight to fp32 and multiply it by the bf16
activation: arithmetic, not the weight's bytes, is their time. On AVX-512 VNNI machines ``int4vnni`` and
``int8vnni`` (`core/models/cpu_vnni.py`) take the same weights (int4 with the file's fp16 scale and min) and round
the activations to int8 per block of 32, as llama.cpp does, for 8-bit dot products. `select_cpu_kernel` picks
per machine (`cpu_isa`); elsewhere, and for fp32 models (whose int4 path must stay exactly the file's weights in
fp32), the layer keeps the reference path. The few-row kernels are each a layer's ``rows`` module
(`Int4PackRows`, `Int4VnniRows`, `Int8PackRows`, `Int8VnniRows`). They are made for few rows (decode); calls of
many rows (prefill chunks, batched decode) run a bf16 GEMM on a dense weight instead: `Int4PackedLinear` keeps a
bf16 copy of its weight for them (2.5 bytes a weight in all), a tied head multiplies the embedding table it was
quantized from.

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
from sluice.core.models import cpu_vnni
from sluice.core.models.quant import QuantizedLinear, dequantize_int4, quantize_int4, quantize_int8, unpack_int4
from torch import nn

logger = logging.getLogger("sluice")

# ISAs whose packed int4/int8 matmuls are vectorized: torch's CPU capabilities (torch.backends.cpu), and ours,
# "AVX512_VNNI": an AVX-512 machine where `cpu_vnni`'s kernels are enabled and built (`cpu_isa`)
PACKED_ISAS = ("AVX2", "AVX512", "AVX512_VNNI")

# Groups of the int4 weights rounded here from dense ones (`Int4PackedLinear.rounded_from`): the smallest torch's
# packing takes, the GGUF's Q4_1 block. The shipped draft head rounded in groups of 64 and 128 (`quant.quantize_model`'s
# choice) proposed drafts of ~0.2 less mean acceptance length on the CPU benchmark's prompts than in groups of 32.
ROUNDED_GROUP_SIZE = 32

# torch's packed CPU matmuls have no public names yet
_aten = torch.ops.aten
pack_int4 = _aten._convert_weight_to_int4pack_for_cpu  # noqa: SLF001
int4pack_mm = _aten._weight_int4pack_mm_for_cpu  # noqa: SLF001
int8pack_mm = _aten._weight_int8pack_mm  # noqa: SLF001

_vnni_enabled = True  # `configure`


def configure(vnni: bool) -> None:
    """Whether `cpu_isa` may name the VNNI kernels (``SLUICE_CPU_VNNI``, which the model runner passes here)."""
    global _vnni_enabled
    _vnni_enabled = vnni


def cpu_capability() -> str:
    """The vector ISA torch's CPU kernels dispatch to on this machine: "AVX512", "AVX2", "DEFAULT", ... ."""
    return torch.backends.cpu.get_cpu_capability()


def cpu_isa() -> str:
    """`cpu_capability`, or "AVX512_VNNI" where the VNNI kernels are enabled and load (`cpu_vnni.load`)."""
    isa = cpu_capability()
    return "AVX512_VNNI" if isa == "AVX512" and _vnni_enabled and cpu_vnni.load() else isa


def select_cpu_kernel(bits: int, dtype: torch.dtype, isa: str) -> str:
    """The kernel a weight-only ``bits``-bit linear layer runs on this CPU for ``dtype`` activations, each
    prepacked for bf16 activations: ``int4vnni`` / ``int8vnni`` (`cpu_vnni`, on "AVX512_VNNI"), ``int4pack`` /
    ``int8pack`` (torch's, on AVX2 or AVX-512); else ``dequantize`` (the reference: the weight dequantized at each
    call)."""
    if dtype != torch.bfloat16 or isa not in PACKED_ISAS or bits not in (4, 8):
        return "dequantize"
    return f"int{bits}{'vnni' if isa == 'AVX512_VNNI' else 'pack'}"


class Int4PackRows(nn.Module):
    """`Int4PackedLinear`'s few-row product by torch's ``int4pack`` kernel: ``(q - 8) * scale + zero`` with
    ``zero = min + 8 * scale``, scale and zero rounded to bf16 (the module doc)."""

    kernel = "int4pack"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> None:
        super().__init__()
        self.group_size = group_size
        q = unpack_int4(qweight, scales.shape[1]).view(qweight.shape[0], -1)
        self.register_buffer("packed", pack_int4(q.to(torch.int32), 2))  # (inner k tiles: unused on the CPU)
        s, z = self.scale_and_zero(scales, mins)
        self.register_buffer("scales_and_zeros", torch.stack((s.t(), z.t()), dim=-1).contiguous())  # [K/g, N, 2]

    @staticmethod
    def scale_and_zero(scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = scales.float()
        return s.to(torch.bfloat16), (mins.float() + 8 * s).to(torch.bfloat16)

    @classmethod
    def weight(cls, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
        """The fp32 ``[N, K]`` weight the kernel multiplies: (q - 8) * s + z == q * s + (z - 8 s), exact in fp32."""
        s, z = (t.float() for t in cls.scale_and_zero(scales, mins))
        return dequantize_int4(qweight, s, z - 8 * s, torch.float32)

    def forward(self, x2: torch.Tensor) -> torch.Tensor:
        return int4pack_mm(x2, self.packed, self.group_size, self.scales_and_zeros)


class Int4VnniRows(nn.Module):
    """`Int4PackedLinear`'s few-row product by `cpu_vnni.int4_mm`: the file's fp16 scale and min as they are, the
    activations rounded to int8 per block of 32."""

    kernel = "int4vnni"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> None:
        super().__init__()
        cpu_vnni.require()
        self.group_size = group_size
        self.out_features = qweight.shape[0]
        self.register_buffer("packed", cpu_vnni.int4_blocks(qweight, scales, mins))

    @staticmethod
    def weight(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
        """The fp32 ``[N, K]`` weight the kernel multiplies: the int4 format's own (fp16 scale and min)."""
        return dequantize_int4(qweight, scales, mins, torch.float32)

    def forward(self, x2: torch.Tensor) -> torch.Tensor:
        return cpu_vnni.int4_mm(x2.contiguous(), self.packed, self.out_features)


class Int4PackedLinear(nn.Module):
    """``y = x @ W^T + bias`` with ``W`` int4 in groups of ``group_size`` along K, prepacked for a CPU kernel of few
    rows (``rows``: `Int4PackRows` or `Int4VnniRows`).

    The packed kernels are GEMVs at heart: at a few rows (decode) they read a quarter of bf16's bytes and win, but
    their time grows with the rows, and from a dozen or so rows on (prefill chunks, batched decode) oneDNN's bf16
    GEMM on a dense weight is faster, several times so at 64 rows and more. From `DENSE_MIN_ROWS` rows the layer
    multiplies a dense bf16 copy of the weight made at load: the few-row kernel's own weight rounded to bf16 (the
    rounding a bf16 model's weights have), so the two paths agree within bf16 rounding (and, for `Int4VnniRows`,
    the activation's int8 rounding), not bit for bit. The copy costs 2 bytes a weight beside the packed half byte;
    dequantizing it at each call instead cost more than the GEMM it fed at batched-decode sizes (several passes
    over the weight per projection, 30 layers)."""

    DENSE_MIN_ROWS = 16

    def __init__(self, rows: nn.Module, dense: torch.Tensor, bias, owns_dense: bool = True) -> None:
        super().__init__()
        self.rows = rows
        self.out_features, self.in_features = dense.shape
        self.group_size = rows.group_size
        if owns_dense:
            self.register_buffer("dense", dense)
        else:  # the weight this was rounded from, the owner's: shared, not a buffer
            self.dense = dense.detach()
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def from_int4(
        cls, qweight, scales, mins, bias, group_size: int, dense=None, kernel: str = "int4pack"
    ) -> Int4PackedLinear:
        """From our int4 format (`quant.quantize_int4`: ``[N, K/2]`` uint8, low nibbles the first half of each
        group; fp16 ``scale`` and ``min`` ``[N, K / group]``), for ``kernel`` ("int4pack" or "int4vnni")."""
        rows_type = Int4VnniRows if kernel == "int4vnni" else Int4PackRows
        owns = dense is None
        if owns:
            dense = rows_type.weight(qweight, scales, mins).to(torch.bfloat16)
        return cls(rows_type(qweight, scales, mins, group_size), dense, bias, owns)

    @classmethod
    def rounded_from(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int4PackedLinear:
        """``weight`` (bf16 ``[N, K]``) rounded to int4 (`quant.quantize_int4`, groups of `ROUNDED_GROUP_SIZE`) for
        the few-row calls of this CPU's int4 kernel; calls of many rows multiply ``weight`` itself, shared, not
        copied. For products whose precision costs only speed, never correctness: a draft head's, whose drafts
        the target verifies."""
        g = ROUNDED_GROUP_SIZE
        kernel = select_cpu_kernel(4, torch.bfloat16, cpu_isa())
        return cls.from_int4(*quantize_int4(weight, g), bias, g, dense=weight, kernel=kernel)

    @property
    def kernel(self) -> str:
        return self.rows.kernel

    def extra_repr(self) -> str:
        return (
            f"{self.kernel}, in_features={self.in_features}, out_features={self.out_features}, group={self.group_size}"
        )

    def dense_weight(self) -> torch.Tensor:
        """``[N, K]`` bf16: the many-row path's weight (the few-row kernel's rounded to bf16, or the one shared)."""
        return self.dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] >= self.DENSE_MIN_ROWS:
            y = F.linear(x2, self.dense, self.bias)
        else:
            y = self.rows(x2)
            if self.bias is not None:
                y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Int8PackRows(nn.Module):
    """`Int8PackedLinear`'s few-row product by torch's ``int8pack`` kernel (the scales rounded to bf16)."""

    kernel = "int8pack"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scales", scales.to(torch.bfloat16).contiguous())

    def one_row(self, x: torch.Tensor) -> torch.Tensor:
        """One row ``[1, K]`` as a plain reduction over K, fp32 ``[N]``: for a compiler to turn into one vectorized
        pass over the weight (`Int8PackedLinear.forward_one_row`)."""
        return (x.reshape(1, -1).float() * self.qweight.float()).sum(-1) * self.scales.float()

    def forward(self, x2: torch.Tensor) -> torch.Tensor:
        return int8pack_mm(x2, self.qweight, self.scales)


class Int8VnniRows(nn.Module):
    """`Int8PackedLinear`'s few-row product by `cpu_vnni.int8_mm` (the weight stored as ``q + 128`` in groups of 16
    rows, the scales rounded to bf16, the activations to 15 bits per block of 32)."""

    kernel = "int8vnni"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        cpu_vnni.require()
        self.out_features = q.shape[0]
        weight, scales = cpu_vnni.int8_lanes(q, scales)
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)

    def forward(self, x2: torch.Tensor) -> torch.Tensor:
        return cpu_vnni.int8_mm(x2.contiguous(), self.weight, self.scales, self.out_features)


class Int8PackedLinear(nn.Module):
    """``y = (x @ Q^T) * scale + bias`` with int8 ``Q`` ``[N, K]`` and one scale per output channel, prepacked for
    ``kernel`` ("int8pack", or "int8vnni" where K is a multiple of 64: that kernel's step).

    With ``dense`` (a bf16 ``[N, K]`` weight the model holds anyway: a tied head's embedding table, shared, not
    copied) calls of `DENSE_MIN_ROWS` rows or more multiply it instead: the int8 kernels' time grows with the rows
    (a GEMV per row), and the head's 49152 columns made it a large part of a batched decode step."""

    DENSE_MIN_ROWS = 8

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, bias, dense: torch.Tensor | None = None, kernel="int8pack"
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        vnni = kernel == "int8vnni" and self.in_features % 64 == 0
        self.rows = Int8VnniRows(qweight, scales) if vnni else Int8PackRows(qweight, scales)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.dense = dense.detach() if dense is not None else None  # not a buffer: the owner's tensor, shared

    @property
    def kernel(self) -> str:
        return self.rows.kernel

    def extra_repr(self) -> str:
        dense = f", dense from {self.DENSE_MIN_ROWS} rows" if self.dense is not None else ""
        return f"{self.kernel}, in_features={self.in_features}, out_features={self.out_features}{dense}"

    def forward_one_row(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` of one row ``[1, K]`` as a plain reduction over K (``int8pack`` layers only), for a compiler to
        turn into one vectorized pass over the int8 weight: at one thread it beat torch's packed kernel, whose time
        there is not its bytes (`core/worker/cpu_compiled.py` times both and keeps the faster)."""
        y = self.rows.one_row(x)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).view(1, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.dense is not None and x2.shape[0] >= self.DENSE_MIN_ROWS:
            return F.linear(x2, self.dense, self.bias).view(*x.shape[:-1], self.out_features)
        y = self.rows(x2)
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
    """Whether this CPU runs a packed int4 matmul vectorized (what `--quantization auto` resolves to int4 for)."""
    return select_cpu_kernel(4, torch.bfloat16, cpu_capability() if isa is None else isa) != "dequantize"


def quantize_tied_head(model: nn.Module, dtype: torch.dtype, isa: str | None = None) -> str | None:
    """Give a model whose LM head is its embedding (``lm_head`` None) an `Int8PackedLinear` head quantized from
    the embedding (module doc), where this CPU packs int8 for ``dtype``; returns its kernel, or None."""
    kernel = select_cpu_kernel(8, dtype, cpu_isa() if isa is None else isa)
    if getattr(model, "lm_head", False) is not None or kernel == "dequantize":
        return None
    table = model.model.embed_tokens.weight.detach()
    q, scales = quantize_int8(table)
    dense = table if table.dtype == torch.bfloat16 else None
    model.lm_head = Int8PackedLinear(q, scales, None, dense=dense, kernel=kernel)
    return model.lm_head.kernel


def pack_for_cpu(model: nn.Module, dtype: torch.dtype, isa: str | None = None) -> dict[str, int]:
    """Replace each `QuantizedLinear` of a CPU model by its packed form where `select_cpu_kernel` picks one (for
    ``isa``, default `cpu_isa`), and quantize a tied LM head (`quantize_tied_head`); returns the layer counts by
    kernel (logged: which kernel runs)."""
    isa = cpu_isa() if isa is None else isa
    counts: dict[str, int] = {}
    targets = [name for name, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    for name in targets:
        lin = model.get_submodule(name)
        kernel = select_cpu_kernel(lin.bits, dtype, isa)
        if kernel != "dequantize":
            bias = lin.bias.detach().to(dtype) if lin.bias is not None else None
            if lin.bits == 4:
                new = Int4PackedLinear.from_int4(lin.qweight, lin.scales, lin.mins, bias, lin.group_size, kernel=kernel)
            else:
                new = Int8PackedLinear(lin.qweight, lin.scales, bias, kernel=kernel)
            model.set_submodule(name, new)
            kernel = new.kernel
        counts[kernel] = counts.get(kernel, 0) + 1
    head = quantize_tied_head(model, dtype, isa)
    if head is not None:
        counts[f"{head} (tied LM head)"] = 1
    if counts:
        logger.info("CPU linear kernels (%s, %s activations): %s", isa, str(dtype).removeprefix("torch."), counts)
    return counts
