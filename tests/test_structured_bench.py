"""`sluice bench structured` at tiny scale (dummy:tiny on the CPU): both runs in one engine with their ratio and the
mask time per step; and ``--compile``'s compile percentiles and first-token latencies."""

from __future__ import annotations

import json

import pytest
from sluice.app.bench.structured import ten_tool_schema
from sluice.app.commands.cli import main as sluice

TINY = ("--model", "dummy:tiny", "--device", "cpu", "--num-kv-blocks", "64", "--max-model-len", "256")


def _run(tmp_path, *argv: str) -> dict:
    out = tmp_path / "result.json"
    assert sluice(["bench", "structured", *argv, *TINY, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_throughput_unconstrained_and_under_a_schema_in_one_run(tmp_path):
    r = _run(tmp_path, "--dataset", "random", "--num-prompts", "3", "--input-len", "8", "--output-len", "6",
             "--repeats", "1")  # fmt: skip
    assert r["ratio_json_over_unconstrained"] == pytest.approx(
        r["output_tokens_per_s_json_schema"] / r["output_tokens_per_s_unconstrained"]
    )
    assert r["exact_output_lens_json"] == 3  # the schema never ends a request early: every row stays constrained
    assert r["masked_steps_per_run"] >= 6 and r["mask_fill_apply_ms_per_step"] > 0


def test_compile_and_first_token_latency(tmp_path):
    r = _run(tmp_path, "--compile", "--compiles", "5", "--first-token-requests", "2")
    for name in ("compile_check", "compile_matcher", "compile_total", "first_token_json", "first_token_unconstrained"):
        assert 0 < r[f"{name}_median_ms"] <= r[f"{name}_p99_ms"]
    assert r["compile_total_p99_ms"] >= r["compile_check_p99_ms"]
    assert r["dataset"]["compiles"] == 5


def test_the_ten_tool_schema_is_new_each_time_and_names_ten_tools():
    a, b = ten_tool_schema(1), ten_tool_schema(2)
    assert a != b and len(a["items"]["anyOf"]) == 10
    names = [c["properties"]["name"]["const"] for c in a["items"]["anyOf"]]
    assert names == [f"tool_{i}" for i in range(10)]
