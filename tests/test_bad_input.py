"""Bad input raises a typed error (a `ValueError` subclass from core/errors.py) whose message names the
field or file, and leaves nothing behind: the engine serves the next request with its whole KV pool."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anyio
import pytest
import torch
from safetensors.torch import load_file, save_file
from sluice.core import LLM, InvalidRequestError, ModelLoadError, SamplingParams

from tests.helpers import save_tiny_hf_model, tiny_hf_config

MAX_MODEL_LEN = 64
NUM_BLOCKS = 16  # 16 x 16 = 256 tokens of KV


# --------------------------------------------------------------------------- sampling parameters


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.01),
        ("top_k", 0),
        ("top_k", -2),
        ("top_k", 2.5),
    ],
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(**{field: value})
    assert isinstance(exc.value, ValueError)
    assert exc.value.param == field and field in str(exc.value) and repr(value) in str(exc.value)


@pytest.mark.parametrize(
    "kwargs",
    [dict(max_tokens=1), dict(temperature=0.0), dict(top_p=1.0), dict(top_p=1e-3), dict(top_k=-1), dict(top_k=1)],
)
def test_edge_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


# --------------------------------------------------------------------------- requests through LLM


@pytest.fixture(scope="module")
def llm():
    llm = LLM(model="dummy:tiny", device="cpu", num_kv_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.close()


def _assert_clean_and_serving(llm: LLM) -> None:
    """Nothing left of the bad call: the next request runs, and afterwards the pool is whole again."""
    out = llm.generate(["still serving?"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    s = llm.engine.stats()
    assert s.kv_blocks_free == s.kv_blocks_total == NUM_BLOCKS
    assert s.num_running == 0 and s.num_waiting == 0
    assert llm.engine.is_healthy


BAD_PROMPTS = {
    "empty string": ("", "prompt"),
    "empty token list": ([], "prompt"),
    "at max_model_len": (list(range(100, 100 + MAX_MODEL_LEN)), "prompt"),
    "over max_model_len": (list(range(100, 300)), "prompt"),
    "token id outside the vocabulary": ([5, 10**7], "prompt"),
    "a bool among the token ids": ([5, True, 7], "prompt"),
    "a float among the token ids": ([5, 6.0], "prompt"),
}


@pytest.mark.parametrize("case", sorted(BAD_PROMPTS))
def test_bad_prompt_alone(llm, case):
    prompt, field = BAD_PROMPTS[case]
    with pytest.raises(InvalidRequestError) as exc:
        llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    assert exc.value.param == field and field in str(exc.value)
    if "max_model_len" in case:
        assert "max_model_len" in str(exc.value)
    _assert_clean_and_serving(llm)


@pytest.mark.parametrize("case", sorted(BAD_PROMPTS))
def test_bad_prompt_among_good_ones_is_raised_typed_and_runs_nothing(llm, case):
    """The typed error itself (not an exception group), and the good requests beside it leave nothing
    behind (long ones, which would still be running if they had been started and forgotten)."""
    prompt, field = BAD_PROMPTS[case]
    steps_before = llm.engine.stats().num_steps
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    with pytest.raises(InvalidRequestError) as exc:
        llm.generate(["a good prompt", prompt, "another good one"], long, use_tqdm=False)
    assert exc.value.param == field
    assert llm.engine.stats().num_steps == steps_before
    _assert_clean_and_serving(llm)


def test_bad_chat_messages(llm):
    with pytest.raises(InvalidRequestError) as exc:
        llm.chat([[{"role": "wizard", "content": "hi"}]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert "messages[0]" in exc.value.param and "role" in str(exc.value)
    _assert_clean_and_serving(llm)


def test_params_list_of_the_wrong_length(llm):
    with pytest.raises(InvalidRequestError) as exc:
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2)], use_tqdm=False)
    assert exc.value.param == "params"


async def test_request_cancelled_before_admission_is_aborted(default_tokenizer):
    """A caller cancelled after its AddRequest went out but before the scheduler answered still sends
    Abort: otherwise the scheduler would run the orphan to its end, holding KV blocks."""
    from sluice.core.frontend.request_actor import RequestLimits, run_request
    from sluice.core.messages import AbortRequest, AddRequest

    inbox_send, inbox_recv = anyio.create_memory_object_stream(8)
    limits = RequestLimits(MAX_MODEL_LEN, 49152, 4096)

    async def caller() -> None:
        async for _ in run_request(
            "orphan", [1, 2, 3], SamplingParams(max_tokens=4), (2,), limits, default_tokenizer, inbox_send
        ):
            pass

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        msg = await inbox_recv.receive()
        assert isinstance(msg, AddRequest)
        tg.cancel_scope.cancel()  # the scheduler never answered
    with anyio.fail_after(1):
        abort = await inbox_recv.receive()
    assert isinstance(abort, AbortRequest) and abort.request_id == "orphan"


# --------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory, default_tokenizer) -> Path:
    d = tmp_path_factory.mktemp("good")
    save_tiny_hf_model(tiny_hf_config("llama", vocab_size=512), d, default_tokenizer)
    return d


def _variant(good: Path, tmp_path: Path, edit) -> Path:
    """A copy of the good checkpoint whose tensors ``edit(dict)`` changed."""
    d = tmp_path / "ckpt"
    shutil.copytree(good, d)
    tensors = load_file(d / "model.safetensors")
    edit(tensors)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return d


def _load_error(model: str) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as exc:
        LLM(model=model, device="cpu", num_kv_blocks=8)
    assert isinstance(exc.value, ValueError)
    return exc.value


def test_good_checkpoint_loads(good_checkpoint):
    with LLM(model=str(good_checkpoint), device="cpu", num_kv_blocks=8) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 2


def test_missing_weight(good_checkpoint, tmp_path):
    d = _variant(good_checkpoint, tmp_path, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    msg = str(_load_error(str(d)))
    assert "missing" in msg and "model.layers.1.mlp.down_proj.weight" in msg and str(d) in msg


def test_missing_shard_of_a_merged_projection_names_the_checkpoint_tensor(good_checkpoint, tmp_path):
    d = _variant(good_checkpoint, tmp_path, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    msg = str(_load_error(str(d)))
    assert "missing" in msg and "model.layers.0.self_attn.k_proj.weight" in msg


def test_extra_weight(good_checkpoint, tmp_path):
    def add(t):
        t["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(4, 4)

    d = _variant(good_checkpoint, tmp_path, add)
    msg = str(_load_error(str(d)))
    assert "unexpected" in msg and "model.layers.0.self_attn.extra_proj.weight" in msg and str(d) in msg


def test_weight_of_the_wrong_shape(good_checkpoint, tmp_path):
    def bad(t):
        t["model.norm.weight"] = torch.ones(63)

    msg = str(_load_error(str(_variant(good_checkpoint, tmp_path, bad))))
    assert "model.norm.weight" in msg and "(63,)" in msg


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    msg = str(_load_error(str(tmp_path)))
    assert "GPT2LMHeadModel" in msg and "config.json" in msg and str(tmp_path) in msg


def test_config_without_architectures(good_checkpoint, tmp_path):
    d = tmp_path / "noarch"
    shutil.copytree(good_checkpoint, d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["architectures"]
    (d / "config.json").write_text(json.dumps(cfg))
    msg = str(_load_error(str(d)))
    assert "architecture" in msg and str(d) in msg


def test_unreadable_config(tmp_path):
    (tmp_path / "config.json").write_text("{ not json")
    msg = str(_load_error(str(tmp_path)))
    assert "config.json" in msg and str(tmp_path) in msg


def test_directory_without_weights(good_checkpoint, tmp_path):
    d = tmp_path / "noweights"
    shutil.copytree(good_checkpoint, d)
    (d / "model.safetensors").unlink()
    msg = str(_load_error(str(d)))
    assert "safetensors" in msg and str(d) in msg


def test_directory_without_tokenizer(good_checkpoint, tmp_path):
    d = tmp_path / "notok"
    d.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(good_checkpoint / name, d / name)
    msg = str(_load_error(str(d)))
    assert "tokenizer" in msg and str(d) in msg


@pytest.mark.parametrize(
    "model",
    ["no-such-model", "smollm2-135m-instruc", "/nonexistent/model-dir", "/nonexistent/model.gguf", "dummy:huge"],
)
def test_unknown_model_alias_or_path(model):
    msg = str(_load_error(model))
    assert model.split(":")[-1] in msg


def test_directory_without_config(tmp_path):
    msg = str(_load_error(str(tmp_path)))
    assert "config.json" in msg and str(tmp_path) in msg
