"""`core/envs.py`: each SLUICE_* variable read with its default and its parsing, and the switches of the floors
below the registry (kv/, core/models/) set from it as they were read before, where they are."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sluice.core import envs

ON_UNLESS_ZERO = [
    "SLUICE_PAD_HEAD_ROWS",
    "SLUICE_GRAPH_ROUTES",
    "SLUICE_PDL",
    "SLUICE_FUSED_REDUCE",
    "SLUICE_DECODE_ROPE",
    "SLUICE_FUSED_ROPE_KV",
    "SLUICE_GEMV",
    "SLUICE_CPU_VNNI",
]


@pytest.fixture
def clean_env(monkeypatch):
    for name in envs.environment_variables:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("name", ON_UNLESS_ZERO)
def test_switches_are_on_unless_zero(clean_env, name):
    assert getattr(envs, name) is True
    for value, on in (("0", False), ("1", True), ("", True), ("off", True)):
        clean_env.setenv(name, value)
        assert getattr(envs, name) is on, value


def test_each_variable_with_its_default_and_its_parsing(clean_env):
    defaults = {
        "SLUICE_API_KEY": None,
        "SLUICE_CACHE_DIR": Path.home() / ".cache" / "sluice",
        "SLUICE_TP_DEVICE": None,
        "SLUICE_ADMITTING": None,
        "SLUICE_STEP_TRACE": None,
        "SLUICE_SUBMIT_CHUNK": 64,
        "SLUICE_EAGER_WARMUP": None,
        "SLUICE_SYNC_DEBUG": False,
        "SLUICE_MOE_DECODE": None,
        "SLUICE_DECODE_BLOCK_N": 128,
        "SLUICE_GEMV_ROWS": None,
        "SLUICE_FP8_GEMV_ROWS": None,
        "SLUICE_FP8_GEMV_SPLIT_MIN_K": None,
        "SLUICE_GEMV_FOLD": frozenset(),
        "SLUICE_FP8_WEIGHT_SCALE": None,
        "SLUICE_FP8_DENSE_LAST_LAYERS": None,
        "SLUICE_FP8_LM_HEAD": None,
        "SLUICE_GRAMMAR_THREADS": None,
    }
    assert {n: getattr(envs, n) for n in defaults} == defaults
    assert set(defaults) | set(ON_UNLESS_ZERO) == set(envs.environment_variables)
    set_to = {
        "SLUICE_API_KEY": ("k", "k"),
        "SLUICE_CACHE_DIR": ("/tmp/c", Path("/tmp/c")),
        "SLUICE_TP_DEVICE": ("cpu", "cpu"),
        "SLUICE_ADMITTING": ("0", 0),
        "SLUICE_STEP_TRACE": ("/tmp/t.json", "/tmp/t.json"),
        "SLUICE_SUBMIT_CHUNK": ("8", 8),
        "SLUICE_SYNC_DEBUG": ("1", True),
        "SLUICE_MOE_DECODE": ("1", True),
        "SLUICE_DECODE_BLOCK_N": ("64", 64),
        "SLUICE_GEMV_ROWS": ("16", 16),
        "SLUICE_FP8_GEMV_ROWS": ("8", 8),
        "SLUICE_FP8_GEMV_SPLIT_MIN_K": ("2048", 2048),
        "SLUICE_GEMV_FOLD": (" norm, silu,", frozenset({"norm", "silu"})),
        "SLUICE_FP8_WEIGHT_SCALE": ("max", "max"),
        "SLUICE_FP8_DENSE_LAST_LAYERS": ("0", 0),
        "SLUICE_FP8_LM_HEAD": ("1", True),
        "SLUICE_GRAMMAR_THREADS": ("4", 4),
    }
    for n, (raw, value) in set_to.items():
        clean_env.setenv(n, raw)
        assert getattr(envs, n) == value, n
    for raw, value in (("0", False), ("1", True), ("yes", None)):
        clean_env.setenv("SLUICE_EAGER_WARMUP", raw)
        assert envs.SLUICE_EAGER_WARMUP is value
    clean_env.setenv("SLUICE_SYNC_DEBUG", "yes")  # only 1 turns it on
    assert envs.SLUICE_SYNC_DEBUG is False
    with pytest.raises(AttributeError):
        envs.SLUICE_NO_SUCH_THING  # noqa: B018


def test_the_attention_backend_and_the_fused_kernels_take_their_switches(clean_env):
    from sluice.core.models.layers import RotaryEmbedding, enable_fused_kernels
    from sluice.kv.attention import get_attention_backend

    backend = get_attention_backend("triton", **envs.attention_backend_options())
    assert (backend.fused_reduce, backend.decode_block_n, backend.rope_in_decode) == (True, 128, True)
    clean_env.setenv("SLUICE_FUSED_REDUCE", "0")
    clean_env.setenv("SLUICE_DECODE_BLOCK_N", "64")
    clean_env.setenv("SLUICE_DECODE_ROPE", "0")
    backend = get_attention_backend("triton", **envs.attention_backend_options())
    assert (backend.fused_reduce, backend.decode_block_n, backend.rope_in_decode) == (False, 64, False)
    assert get_attention_backend("torch", **envs.attention_backend_options()).name == "torch"

    from types import SimpleNamespace

    cfg = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    assert envs.fused_kernel_options() == {"gemv": True, "fused_rope_kv": True, "moe_decode": None}
    clean_env.setenv("SLUICE_FUSED_ROPE_KV", "0")
    clean_env.setenv("SLUICE_GEMV", "0")
    clean_env.setenv("SLUICE_MOE_DECODE", "1")
    assert envs.fused_kernel_options() == {"gemv": False, "fused_rope_kv": False, "moe_decode": True}
    r = RotaryEmbedding(cfg, 16, 64)
    assert enable_fused_kernels(r, **envs.fused_kernel_options()) == 1 and r.fused_write is None


def test_configure_kernels_sets_pdl_and_the_gemvs_rows_and_folds(clean_env, monkeypatch):
    from sluice.core.models import gemv
    from sluice.kv.attention.pdl import pdl_enabled

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    try:
        envs.configure_kernels()
        assert pdl_enabled(torch.device("cuda", 0))
        assert (gemv.max_rows(), gemv.fold_norm_rows(), gemv.fold_silu_rows()) == (gemv.MAX_ROWS, 0, 0)
        clean_env.setenv("SLUICE_PDL", "0")
        clean_env.setenv("SLUICE_GEMV_ROWS", "16")
        clean_env.setenv("SLUICE_GEMV_FOLD", "norm")
        envs.configure_kernels()
        assert not pdl_enabled(torch.device("cuda", 0))
        assert (gemv.max_rows(), gemv.fold_norm_rows(), gemv.fold_silu_rows()) == (16, gemv.FOLD_NORM_ROWS, 0)
        clean_env.setenv("SLUICE_GEMV_ROWS", "1000")  # at most the GEMV's own limit
        clean_env.setenv("SLUICE_GEMV_FOLD", "silu")
        envs.configure_kernels()
        assert (gemv.max_rows(), gemv.fold_norm_rows(), gemv.fold_silu_rows()) == (
            gemv.MAX_ROWS,
            0,
            gemv.FOLD_NORM_ROWS,
        )
    finally:
        for name in ("SLUICE_PDL", "SLUICE_GEMV_ROWS", "SLUICE_GEMV_FOLD"):
            clean_env.delenv(name, raising=False)
        envs.configure_kernels()  # the defaults again, for the tests after this one
        pdl_enabled.cache_clear()  # no answer from the faked GPU


def test_the_cache_dir_is_where_a_gguf_file_is_converted(clean_env, tmp_path, monkeypatch):
    """The engine resolves models with ``SLUICE_CACHE_DIR``; the loader takes it as a parameter."""
    from sluice.core.models import loader

    seen = []
    monkeypatch.setattr(loader, "gguf_to_hf_dir", lambda path, cache_dir: seen.append(cache_dir) or 1 / 0)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    clean_env.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ZeroDivisionError):
        loader.resolve_model(str(gguf), envs.SLUICE_CACHE_DIR)
    with pytest.raises(ZeroDivisionError):
        loader.resolve_model(str(gguf))
    assert seen == [tmp_path / "cache", loader.DEFAULT_CACHE_DIR]
