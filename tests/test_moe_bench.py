"""The weight-read floor the MoE GPU runs compare a batch-1 step with: the bytes of a decode step that reads only
its chosen experts (`scripts/gpu_moe_check.py floor`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _check_script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_moe_check.py"
    spec = importlib.util.spec_from_file_location("gpu_moe_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_decode_steps_bytes_count_only_the_chosen_experts():
    """Mixtral-8x7B: 46.7B parameters, of which a token reads 2 of 8 experts per layer and no embedding table;
    the published active count is 12.9B with the embedding (0.13B)."""
    row = _check_script().step_bytes("dummy:mixtral-8x7b")
    assert row["params"] / 1e9 == pytest.approx(46.70, abs=0.01)
    assert row["active_params"] / 1e9 == pytest.approx(12.9 - 0.131, abs=0.05)
    assert row["step_bytes"] == 2 * row["active_params"]
