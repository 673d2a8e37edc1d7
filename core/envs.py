"""Every ``SLUICE_*`` environment variable the engine reads, declared, typed and documented in one place.

Most are switches for side-by-side timing (a kernel against its predecessor), a few are for debugging or
deployment. Each is read when its attribute is asked for (``envs.SLUICE_STEP_TRACE``), not at import, so a
variable set before that point (a test's ``monkeypatch.setenv``) counts, as it did where it was read before.
Nothing else in app/, core/, kv/ or spec/ reads a ``SLUICE_*`` variable (`tests/test_structure.py`).

`kv/` and `core/models/` sit below this floor: their switches are parameters (the Triton attention backend's
constructor, `enable_fused_kernels`) or a configure call (PDL, the GEMV's rows and folds), which the model runner
sets from here: `attention_backend_options`, `fused_kernel_options`, `configure_kernels`.

The shape of vLLM's ``envs.py``: a table of readers, a module ``__getattr__``, and the typed names for checkers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    SLUICE_API_KEY: str | None = None
    SLUICE_CACHE_DIR: Path = Path.home() / ".cache" / "sluice"
    SLUICE_ADMITTING: int | None = None
    SLUICE_STEP_TRACE: str | None = None
    SLUICE_TP_DEVICE: str | None = None
    SLUICE_EAGER_WARMUP: bool | None = None
    SLUICE_SYNC_DEBUG: bool = False
    SLUICE_PAD_HEAD_ROWS: bool = True
    SLUICE_GRAPH_ROUTES: bool = True
    SLUICE_PDL: bool = True
    SLUICE_FUSED_REDUCE: bool = True
    SLUICE_DECODE_BLOCK_N: int = 128
    SLUICE_DECODE_ROPE: bool = True
    SLUICE_FUSED_ROPE_KV: bool = True
    SLUICE_GEMV: bool = True
    SLUICE_MOE_DECODE: bool | None = None
    SLUICE_CPU_VNNI: bool = True
    SLUICE_GEMV_ROWS: int | None = None
    SLUICE_FP8_GEMV_ROWS: int | None = None
    SLUICE_FP8_GEMV_SPLIT_MIN_K: int | None = None
    SLUICE_GEMV_FOLD: frozenset[str] = frozenset()
    SLUICE_SUBMIT_CHUNK: int = 64
    SLUICE_FP8_WEIGHT_SCALE: str | None = None
    SLUICE_FP8_DENSE_LAST_LAYERS: int | None = None
    SLUICE_FP8_LM_HEAD: bool | None = None
    SLUICE_GRAMMAR_THREADS: int | None = None


@dataclass(frozen=True, slots=True)
class Variable:
    """One variable: how its value is read (with its default) and what it does."""

    read: Callable[[], Any]
    doc: str


def _str(name: str) -> Callable[[], str | None]:
    return lambda: os.environ.get(name)


def _on_unless_zero(name: str) -> Callable[[], bool]:
    """On by default; ``0`` turns it off (any other value leaves it on)."""
    return lambda: os.environ.get(name, "1") != "0"


def _on_if_one(name: str) -> Callable[[], bool]:
    """Off by default; only ``1`` turns it on."""
    return lambda: os.environ.get(name) == "1"


def _int(name: str, default: int | None) -> Callable[[], int | None]:
    def read() -> int | None:
        value = os.environ.get(name)
        return default if value is None else int(value)

    return read


def _tristate(name: str) -> Callable[[], bool | None]:
    """``1``: True, ``0``: False, anything else (unset): None, the engine decides."""
    return lambda: {"1": True, "0": False}.get(os.environ.get(name, ""))


def _names(name: str) -> Callable[[], frozenset[str]]:
    """A comma-separated list of names (empty by default)."""
    return lambda: frozenset(f.strip() for f in os.environ.get(name, "").split(",") if f.strip())


environment_variables: dict[str, Variable] = {
    # -- deployment -------------------------------------------------------------------------------------
    "SLUICE_API_KEY": Variable(
        _str("SLUICE_API_KEY"),
        "`sluice serve --api-key`'s default: require 'Authorization: Bearer KEY' on /v1/* (unset: no key).",
    ),
    "SLUICE_CACHE_DIR": Variable(
        lambda: Path(os.environ.get("SLUICE_CACHE_DIR", Path.home() / ".cache" / "sluice")),
        "The folder of converted models (a GGUF file as a Hugging Face folder); default ~/.cache/sluice.",
    ),
    "SLUICE_TP_DEVICE": Variable(
        _str("SLUICE_TP_DEVICE"),
        "A tensor-parallel rank started on another host (`python -m sluice.core.worker.tp.worker`): its device "
        "type, as the engine's --device (unset: cuda where there is a GPU, else cpu).",
    ),
    # -- the engine's pacing and tracing ---------------------------------------------------------------
    "SLUICE_ADMITTING": Variable(
        _int("SLUICE_ADMITTING", None),
        "How many of a burst's requests reach the scheduler at a time (unset: `ADMITTING_AT_ONCE` of "
        "core/frontend/engine.py); 0 sends them all at once (for comparison).",
    ),
    "SLUICE_STEP_TRACE": Variable(
        _str("SLUICE_STEP_TRACE"),
        "A file: every collected step's shape and device time, written there as JSON when the executor ends "
        "(`scripts/step_mix.py --trace FILE` reads it).",
    ),
    "SLUICE_SUBMIT_CHUNK": Variable(
        _int("SLUICE_SUBMIT_CHUNK", 64),
        "Benchmarks: a burst's callers are spawned this many at a time, the event loop's turn between "
        "(default 64; 0: all at once).",
    ),
    # -- the model runner -------------------------------------------------------------------------------
    "SLUICE_EAGER_WARMUP": Variable(
        _tristate("SLUICE_EAGER_WARMUP"),
        "The largest eager step run once at start-up: 0 skips it, 1 runs it on the CPU too (tests); unset: on "
        "CUDA only.",
    ),
    "SLUICE_SYNC_DEBUG": Variable(
        _on_if_one("SLUICE_SYNC_DEBUG"),
        "1: torch's sync debug mode on CUDA after start-up, a warning (with where) at each call that makes the "
        "host wait for the device.",
    ),
    "SLUICE_PAD_HEAD_ROWS": Variable(
        _on_unless_zero("SLUICE_PAD_HEAD_ROWS"),
        "The LM head's rows padded to a few fixed counts (default); 0 computes the rows as they are "
        "(launches that wait for the device).",
    ),
    "SLUICE_GRAPH_ROUTES": Variable(
        _on_unless_zero("SLUICE_GRAPH_ROUTES"),
        "Each step replays the CUDA graph timed fastest for its size (default); 0: its smallest graph.",
    ),
    # -- kernels (side-by-side timing) -----------------------------------------------------------------
    "SLUICE_PDL": Variable(
        _on_unless_zero("SLUICE_PDL"),
        "Programmatic dependent launch on sm_90+ (default, kv/attention/pdl.py); 0 turns it off.",
    ),
    "SLUICE_FUSED_REDUCE": Variable(
        _on_unless_zero("SLUICE_FUSED_REDUCE"),
        "Decode attention's splits merged by their last program (default); 0: a reduce kernel.",
    ),
    "SLUICE_DECODE_BLOCK_N": Variable(
        _int("SLUICE_DECODE_BLOCK_N", 128),
        "Keys per tile of the decode attention kernel (default 128).",
    ),
    "SLUICE_DECODE_ROPE": Variable(
        _on_unless_zero("SLUICE_DECODE_ROPE"),
        "A small decode step's RoPE and KV write done by the decode attention kernel (default); 0: their own "
        "kernel before it.",
    ),
    "SLUICE_FUSED_ROPE_KV": Variable(
        _on_unless_zero("SLUICE_FUSED_ROPE_KV"),
        "RoPE and the KV write in one kernel (default); 0: two kernels.",
    ),
    "SLUICE_GEMV": Variable(
        _on_unless_zero("SLUICE_GEMV"),
        "The few-row GEMV for 16-bit linear layers (default, core/models/gemv.py); 0 keeps cuBLAS for all.",
    ),
    "SLUICE_MOE_DECODE": Variable(
        _tristate("SLUICE_MOE_DECODE"),
        "A mixture-of-experts layer's calls of a few tokens as three GEMV kernels, router included "
        "(core/models/moe_decode.py): 1 for every MoE model, 0 for none (the grouped GEMMs for every call); unset: "
        "for models of many small experts (moe_decode.preferred: Qwen3-MoE, not Mixtral).",
    ),
    "SLUICE_CPU_VNNI": Variable(
        _on_unless_zero("SLUICE_CPU_VNNI"),
        "The int4/int8 CPU kernels of AVX-512 VNNI machines, activations rounded to int8 per block of 32 "
        "(default, core/models/cpu_vnni.py); 0 keeps torch's packed kernels (bf16 activations).",
    ),
    "SLUICE_GEMV_ROWS": Variable(
        _int("SLUICE_GEMV_ROWS", None),
        "Rows up to which a linear layer takes the GEMV, at most its `MAX_ROWS` (unset: `MAX_ROWS`).",
    ),
    "SLUICE_FP8_GEMV_ROWS": Variable(
        _int("SLUICE_FP8_GEMV_ROWS", None),
        "Rows up to which an fp8 linear layer takes its GEMV kernel, past them torch._scaled_mm (unset: "
        "`fp8_kernels.GEMV_ROWS`).",
    ),
    "SLUICE_FP8_GEMV_SPLIT_MIN_K": Variable(
        _int("SLUICE_FP8_GEMV_SPLIT_MIN_K", None),
        "The fewest K elements of a split-K range in the fp8 GEMV (unset: `fp8_kernels.SPLIT_MIN_K`; 2048 was "
        "the rule before 2026-12-07).",
    ),
    "SLUICE_GEMV_FOLD": Variable(
        _names("SLUICE_GEMV_FOLD"),
        "Comma-separated kernels folded into a GEMV: norm (into the one after it), silu (into the gate/up one "
        "before it); default none.",
    ),
    "SLUICE_FP8_WEIGHT_SCALE": Variable(
        _str("SLUICE_FP8_WEIGHT_SCALE"),
        "How --quantization fp8 scales each weight row at load: max (default, amax / 448) or mse (the scale of "
        "least reconstruction error, core/models/fp8_scales.py).",
    ),
    "SLUICE_FP8_DENSE_LAST_LAYERS": Variable(
        _int("SLUICE_FP8_DENSE_LAST_LAYERS", None),
        "How many of the last decoder layers --quantization fp8 keeps in the model's dtype (unset: 1, "
        "core/models/fp8_recipe.py; 0 makes every layer fp8).",
    ),
    "SLUICE_FP8_LM_HEAD": Variable(
        _tristate("SLUICE_FP8_LM_HEAD"),
        "1: --quantization fp8 makes the LM head fp8 too (unset or 0: it stays in the model's dtype; never with "
        "a draft head; core/models/fp8_recipe.py).",
    ),
    "SLUICE_GRAMMAR_THREADS": Variable(
        _int("SLUICE_GRAMMAR_THREADS", None),
        "llguidance's threads for a step's grammar masks and token advances (unset: the usable cores less two, "
        "at most 16; core/structured/llguidance_backend.py).",
    ),
}


def __getattr__(name: str) -> Any:
    variable = environment_variables.get(name)
    if variable is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return variable.read()


def __dir__() -> list[str]:
    return [*globals(), *environment_variables]


# -- the switches of the floors below, as they take them ---------------------------------------------------
def attention_backend_options() -> dict[str, Any]:
    """The Triton attention backend's constructor switches (`get_attention_backend`'s options)."""
    return {
        "fused_reduce": __getattr__("SLUICE_FUSED_REDUCE"),
        "decode_block_n": __getattr__("SLUICE_DECODE_BLOCK_N"),
        "rope_in_decode": __getattr__("SLUICE_DECODE_ROPE"),
    }


def fused_kernel_options() -> dict[str, Any]:
    """`enable_fused_kernels`' switches."""
    return {
        "gemv": __getattr__("SLUICE_GEMV"),
        "fused_rope_kv": __getattr__("SLUICE_FUSED_ROPE_KV"),
        "moe_decode": __getattr__("SLUICE_MOE_DECODE"),
    }


def configure_kernels() -> None:
    """Set the kernels' process-wide switches (asked at every launch, so not parameters): PDL, the GEMV's rows and
    folds, the fp8 recipe and the CPU's VNNI kernels (asked at load). The model runner calls it before it builds
    anything that launches them."""
    from sluice.core.models import cpu_linear, fp8_kernels, fp8_recipe, gemv
    from sluice.kv.attention import pdl

    cpu_linear.configure(vnni=__getattr__("SLUICE_CPU_VNNI"))
    pdl.configure(enabled=__getattr__("SLUICE_PDL"))
    fp8_recipe.configure(
        __getattr__("SLUICE_FP8_WEIGHT_SCALE"),
        __getattr__("SLUICE_FP8_DENSE_LAST_LAYERS"),
        __getattr__("SLUICE_FP8_LM_HEAD"),
    )
    gemv.configure(rows=__getattr__("SLUICE_GEMV_ROWS"), folds=__getattr__("SLUICE_GEMV_FOLD"))
    fp8_kernels.set_gemv_rows(__getattr__("SLUICE_FP8_GEMV_ROWS"))
    fp8_kernels.set_split_min_k(__getattr__("SLUICE_FP8_GEMV_SPLIT_MIN_K"))


# -- other programs' variables the engine reads (OpenMP's, for `core/cpu_threads.py`) --------------------------
def omp_num_threads() -> int | None:
    """``OMP_NUM_THREADS`` as the count of one parallel level: its first entry (OpenMP reads ``4,2`` as nested
    levels); None when unset or not a positive integer (OpenMP ignores such a value too)."""
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


_OPENMP_SET_HERE: list[str] = []  # the OpenMP variables this process set itself, not its caller


def set_default_openmp_waits(policy: str, spin_count: int) -> bool:
    """``OMP_WAIT_POLICY`` and libgomp's ``GOMP_SPINCOUNT`` (its spin before a wait sleeps; it overrides what the
    policy implies) for this process and the processes it starts, unless the caller set either (then False):
    OpenMP reads them once, when its runtime loads (with torch)."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return False
    os.environ["OMP_WAIT_POLICY"] = policy
    os.environ["GOMP_SPINCOUNT"] = str(spin_count)
    _OPENMP_SET_HERE[:] = ["OMP_WAIT_POLICY", "GOMP_SPINCOUNT"]
    return True


def openmp_vars_set_here() -> tuple[str, ...]:
    """The OpenMP variables `set_default_openmp_waits` set in this process (a peer program started from it, such
    as llama.cpp in a benchmark, should run with its own defaults, not sluice's)."""
    return tuple(_OPENMP_SET_HERE)
