"""int4 and int8 matmuls of a few rows for AVX-512 VNNI CPUs: `cpu_vnni.cpp`, built at first use.

torch's packed CPU kernels (``int4pack``, ``int8pack``: `core/models/cpu_linear.py`) convert each weight to fp32
and multiply it by the bf16 activation: a decode step of the default model spends most of its time there, in
arithmetic, not in reading its ~50 MB of int4 weights. llama.cpp rounds the activations to int8 per block of 32
instead, and sums 64 products of 8-bit values an instruction (``vpdpbusd``). These kernels do the same: the weights'
values as stored (int4 in blocks of 32 with an fp16 scale and min, a GGUF Q4_1 block; int8 per output channel),
laid out at load in groups of 16 output rows, a vector lane per row (`int4_blocks`, `int8_lanes`; the source's
header says why); x rounded to int8 per block of 32 at each call (for the int8 kernel, an LM head's, to 15 bits: the
rounding's residual rounded again, as the 8-bit x turned logit near-ties); the sums in fp32 (the source's comment has
the algebra). The cost is the activation's rounding: the int4 outputs differ from the bf16 kernels' by about a
hundredth of their scale.

Built with torch's C++ extension loader (a C++ compiler and ninja on the machine; the build is cached under torch's
extensions folder) where the CPU has the instructions (`vnni_supported`); `load` says whether the ops are there.
The ops are registered as ``torch.ops.sluice_cpu.*`` with fake implementations, so a compiled decode step
(`core/worker/cpu_compiled.py`) calls them from its generated code. The library also carries that step's decode
attention (`cpu_attention.cpp`, called by `kv/attention/cpu_decode.py`), built and loaded with the matmuls.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import time
from pathlib import Path

import torch
from sluice.core.models.quant import unpack_int4

logger = logging.getLogger("sluice")

# the matmuls, and built into the same library the decode step's attention for AVX-512 CPUs (`cpu_attention.cpp`)
SOURCES = (Path(__file__).with_name("cpu_vnni.cpp"), Path(__file__).with_name("cpu_attention.cpp"))
# what the source's intrinsics need (Linux /proc/cpuinfo names)
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma")
# -fopenmp: `at::parallel_for` is OpenMP in the header itself (without it, one thread); the library it links,
# libgomp.so.1, resolves to the copy torch has loaded, as inductor's generated code does
CFLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma"]
BLOCK = 32  # activations per rounding block; weights per int4 scale and min
LANES = 16  # output rows per group of the kernels' weights (`cpu_vnni.cpp`): a 32-bit lane each


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo is not there)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def vnni_supported(flags: frozenset[str] | None = None) -> bool:
    return set(REQUIRED_FLAGS) <= (cpu_flags() if flags is None else flags)


@functools.cache
def load() -> bool:
    """Build (or find built) and load the kernels once per process; False where the CPU lacks the instructions or
    the build fails (no compiler: logged once), and the packed layers keep torch's kernels."""
    if not vnni_supported():
        return False
    from torch.utils import cpp_extension

    name = f"sluice_cpu_vnni_{source_hash()}"  # a build folder per source: checkouts never rebuild each other's
    try:
        folder = Path(cpp_extension._get_build_directory(name, verbose=False))  # noqa: SLF001 (no public name)
        _remove_stale_lock(folder / "lock")
        if not any(folder.glob("*.so")):
            logger.info("building the AVX-512 VNNI kernels (once per source, in %s)", folder)
        cpp_extension.load(
            name=name,
            sources=[str(p) for p in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as e:  # noqa: BLE001 (any build failure leaves torch's kernels, which work everywhere)
        logger.warning("the AVX-512 VNNI kernels did not build (%s); the CPU keeps torch's packed kernels", e)
        return False
    torch.library.register_fake("sluice_cpu::int4_vnni_mm")(_rows_by_n)
    torch.library.register_fake("sluice_cpu::int8_vnni_mm")(_rows_by_n)
    torch.library.register_fake("sluice_cpu::decode_attention")(_like_query)
    return True


def _remove_stale_lock(lock: Path, max_age_s: float = 600.0) -> None:
    """torch's builder waits without end on a lock a killed build left behind (a build takes seconds)."""
    with contextlib.suppress(FileNotFoundError):
        if time.time() - lock.stat().st_mtime > max_age_s:
            logger.warning("removing a stale build lock: %s", lock)
            lock.unlink()


def source_hash() -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + " ".join(CFLAGS).encode()).hexdigest()[:12]


def require() -> None:
    """`load`, or a RuntimeError where the kernels are not there (for layers built for them explicitly)."""
    if not load():
        raise RuntimeError("the AVX-512 VNNI kernels are not available on this machine (cpu_vnni.load)")


def _rows_by_n(x: torch.Tensor, *weights_then_n) -> torch.Tensor:
    """Both matmuls' output: ``[rows, n]``, ``n`` their last argument."""
    return x.new_empty((x.shape[0], weights_then_n[-1]))


def _like_query(query: torch.Tensor, *_) -> torch.Tensor:
    return query.new_empty(query.shape)


def _by_lanes(t: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """``[N, ...]`` -> ``[ceil(N / 16), 16, ...]``: rows in groups of `LANES`, the last group filled with ``fill``."""
    pad = -t.shape[0] % LANES
    if pad:
        t = torch.cat((t, t.new_full((pad, *t.shape[1:]), fill)))
    return t.view(-1, LANES, *t.shape[1:])


def int4_blocks(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The int4 format (`quant.quantize_int4`, groups of a multiple of 32) -> the kernel's form (`cpu_vnni.cpp`'s
    header), uint8 ``[groups of 16 rows, blocks * 320]``: per block of 32 weights four 64-byte chunks, chunk c's
    byte 4r + j holding row r's codes at k = 4c + j (low nibble) and 16 + 4c + j (high), then the 16 rows' fp16
    scales and their fp16 mins (a larger group's repeated over its blocks)."""
    n, groups = scales.shape
    codes = unpack_int4(qweight, groups).reshape(n, -1, 2, 4, 4)  # [N, blocks, half, chunk, j]
    lanes = _by_lanes(codes).permute(0, 2, 4, 1, 5, 3)  # [G, blocks, chunk, 16, j, half]
    weights = (lanes[..., 0] | (lanes[..., 1] << 4)).reshape(*lanes.shape[:2], -1)  # [G, blocks, 256]
    repeat = codes.shape[1] // groups
    per_block = [
        _by_lanes(t.to(torch.float16).repeat_interleave(repeat, dim=1)).transpose(1, 2).contiguous().view(torch.uint8)
        for t in (scales, mins)
    ]  # [G, blocks, 32] each
    return torch.cat((weights, *per_block), dim=-1).reshape(weights.shape[0], -1).contiguous()


def int8_lanes(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 ``[N, K]`` and per-row scales -> the kernel's form (`cpu_vnni.cpp`'s header): ``q + 128`` (its unsigned
    operand) per group of 16 rows in 64-byte chunks, chunk c's byte 4r + j holding row r's k = 4c + j; bf16 scales
    ``[groups * 16]``."""
    u = (q.to(torch.int16) + 128).to(torch.uint8)
    lanes = _by_lanes(u.view(u.shape[0], -1, 4), fill=128)  # [G, 16, K / 4, 4]
    weight = lanes.transpose(1, 2).reshape(lanes.shape[0], -1).contiguous()
    return weight, _by_lanes(scales.to(torch.bfloat16)).reshape(-1).contiguous()


def int4_mm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """bf16 ``x`` ``[rows, K]`` times the `int4_blocks` weight of ``n`` rows, transposed -> bf16 ``[rows, n]``."""
    return torch.ops.sluice_cpu.int4_vnni_mm(x, packed, n)


def attention_fits(head_size: int, kv_dtype: torch.dtype) -> bool:
    """Whether the library's decode attention (called by `kv/attention/cpu_decode.py`) serves a cache of these heads:
    16-wide vectors of bf16 or fp32."""
    return head_size % 16 == 0 and kv_dtype in (torch.bfloat16, torch.float32)


def int8_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """bf16 ``x`` ``[rows, K]`` (K a multiple of 64) times the `int8_lanes` weight of ``n`` rows, transposed -> bf16
    ``[rows, n]``."""
    return torch.ops.sluice_cpu.int8_vnni_mm(x, weight, scales, n)
