"""The Hugging Face peer and result files.

The GPU machine has transformers 5.17 (this one a later 5.x); to run these tests against 5.17 here:
``pip download --no-deps transformers==5.17.0 "huggingface-hub<2"``, ``pip install --no-deps --target DIR`` both
wheels and psutil, then ``PYTHONPATH=DIR .venv/bin/python -m pytest tests/test_bench_peer.py``."""

import json

import pytest
import torch
from sluice.app.bench.datasets import BenchRequest, sample_random
from sluice.app.bench.hf_peer import (
    PeerResult,
    load_hf_model,
    run_hf_continuous_batching,
    run_hf_generate,
)
from sluice.app.bench.results import format_table, machine_info, versions, write_result


@pytest.fixture(scope="module")
def tiny_model():
    return load_hf_model("dummy:tiny", device="cpu", dtype=torch.float32)


def _requests() -> list[BenchRequest]:
    """Four requests with different prompt and forced output lengths."""
    shapes = [(12, 8), (5, 3), (20, 13), (9, 1)]
    return [
        BenchRequest(
            prompt_token_ids=sample_random(1, n_in, n_out, 49152, seed=i)[0].prompt_token_ids,
            output_len=n_out,
        )
        for i, (n_in, n_out) in enumerate(shapes)
    ]


def test_dummy_model_is_deterministic(tiny_model):
    cfg = tiny_model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (64, 2, 49152)
    assert tiny_model.lm_head.weight is tiny_model.model.embed_tokens.weight  # tied
    again = load_hf_model("dummy:tiny")
    for (name, a), (_, b) in zip(tiny_model.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    std = tiny_model.model.embed_tokens.weight.std().item()
    assert 0.018 < std < 0.022


def test_hf_continuous_batching_forced_lengths(tiny_model):
    reqs = _requests()
    res = run_hf_continuous_batching(tiny_model, reqs, timeout_s=120)
    assert isinstance(res, PeerResult)
    assert (res.num_requests, res.num_finished) == (4, 4)
    assert res.output_lens == [r.output_len for r in reqs]
    assert res.output_tokens == sum(r.output_len for r in reqs)
    assert res.prompt_tokens == sum(len(r.prompt_token_ids) for r in reqs)
    assert res.elapsed_s > 0 and res.output_tokens_per_s > 0
    assert res.total_tokens_per_s > res.output_tokens_per_s


def test_hf_continuous_batching_with_its_loop_outside_inference_mode(tiny_model, monkeypatch):
    """transformers 5.17 (the GPU machine's) runs the generation thread outside inference mode, whatever the caller
    is in (later versions copy the caller's mode into the thread); its first step resets the batch processor that
    `warmup` built. Starting the thread that way here reproduces 5.17: every request must still finish."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    start = ContinuousBatchingManager.start

    def start_outside_inference_mode(self) -> None:
        with torch.inference_mode(False):
            start(self)

    monkeypatch.setattr(ContinuousBatchingManager, "start", start_outside_inference_mode)
    reqs = _requests()
    res = run_hf_continuous_batching(tiny_model, reqs, timeout_s=120)
    assert res.error is None and res.incomplete_reason is None
    assert res.num_finished == 4 and res.output_lens == [r.output_len for r in reqs]


def test_hf_continuous_batching_failure_is_reported(tiny_model, monkeypatch):
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

    def broken_step(self, model) -> None:
        raise RuntimeError("step exploded")

    monkeypatch.setattr(ContinuousBatchProcessor, "_generation_step", broken_step)
    res = run_hf_continuous_batching(tiny_model, _requests(), timeout_s=60)
    assert res.num_finished == 0 and res.output_tokens == 0 and not res.timed_out
    assert "step exploded" in res.error
    assert "0 of 4 finished" in res.incomplete_reason and "step exploded" in res.incomplete_reason
    assert res.figures()["error"] == res.error


def test_hf_continuous_batching_time_limit_is_reported(tiny_model):
    res = run_hf_continuous_batching(tiny_model, _requests(), timeout_s=0.0)
    assert res.timed_out and res.error is None and res.num_finished == 0
    assert res.incomplete_reason == "0 of 4 finished within the 0 s limit"
    assert res.figures()["timeout_s"] == 0.0 and res.figures()["timed_out"] is True


def test_hf_generate_forced_lengths(tiny_model):
    reqs = _requests()
    res = run_hf_generate(tiny_model, reqs, batch_size=2)
    assert res.num_finished == 4 and res.output_lens == [r.output_len for r in reqs]


def test_write_result_and_table(tmp_path):
    res = PeerResult.build("peer", _requests(), [8, 3, 13, 1], [True] * 4, 2.0)
    rec = write_result(tmp_path / "sub" / "r.json", "sluice bench x", "dummy:tiny", {"name": "random"}, res.figures())
    on_disk = json.loads((tmp_path / "sub" / "r.json").read_text())
    assert on_disk == json.loads(json.dumps(rec))
    for key in ("command", "machine", "versions", "date", "model", "dataset", "output_tokens_per_s"):
        assert key in on_disk
    assert on_disk["output_tokens"] == 25 and on_disk["output_tokens_per_s"] == 12.5
    assert on_disk["date"].endswith("+00:00")
    with pytest.raises(ValueError):
        write_result(tmp_path / "bad.json", "c", "m", "d", {"model": 1})
    assert machine_info()["cores"] >= 1 and versions()["sluice"] == "0.1.0"
    table = format_table([{"name": "a", "tok/s": 1.5}, {"name": "bb", "tok/s": 123.25}]).splitlines()
    assert len(table) == 4 and len({len(line) for line in table[1:]}) == 1


def test_cb_config_maps_fields_across_transformers_versions():
    from dataclasses import dataclass

    from sluice.app.bench.hf_peer import _cb_config

    @dataclass
    class Old:  # transformers 5.17: no page_size, no auto_switch_to_flash
        block_size: int = 256
        num_blocks: int | None = None

    @dataclass
    class New:
        page_size: int = 256
        block_size: int = 256
        auto_switch_to_flash: bool = False

    old = _cb_config(Old, page_size=64, num_blocks=9, auto_switch_to_flash=True)
    assert (old.block_size, old.num_blocks) == (64, 9)
    new = _cb_config(New, page_size=64, num_blocks=9, auto_switch_to_flash=True)
    assert (new.page_size, new.block_size, new.auto_switch_to_flash) == (64, 256, True)
