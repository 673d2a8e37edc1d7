"""Greedy parity with transformers on tiny random checkpoints loaded from disk (fp32, CPU).

Two Hugging Face directories (config, safetensors, the default model's tokenizer) are written once per
module: a `LlamaForCausalLM` with GQA, llama3 rope scaling and an untied head, and a `Qwen2ForCausalLM`
with qkv bias and a tied head. Every parameter is random (biases and norm weights included), so a
weight that loads into the wrong place shows. Prompts sit around block boundaries and run past the
llama3 original context of 64 positions.
"""

from __future__ import annotations

import pytest
import torch
from sluice.core import LLM, SamplingParams

from tests.helpers import (
    LLAMA3_ROPE,
    assert_greedy_match,
    hf_greedy,
    prompt_of_length,
    save_tiny_hf_model,
    tiny_hf_config,
)

NEW_TOKENS = 24
BLOCK_SIZE = 16
# on and around block boundaries, past the llama3 original context (64), and one long prompt
PROMPT_LENS = [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 130]
ARCHS = ["llama", "qwen2"]


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory, default_tokenizer):
    """arch -> (model directory, transformers reference model)."""
    out = {}
    for i, arch in enumerate(ARCHS):
        d = tmp_path_factory.mktemp(f"tiny-{arch}")
        ref = save_tiny_hf_model(tiny_hf_config(arch, len(default_tokenizer)), d, default_tokenizer, seed=i)
        out[arch] = (str(d), ref)
    return out


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    ps = [prompt_of_length(default_tokenizer, n, f"Story {n}:") for n in PROMPT_LENS]
    assert [len(p) for p in ps] == PROMPT_LENS
    return ps


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    llms = {
        arch: LLM(model=d, device="cpu", num_kv_blocks=256, block_size=BLOCK_SIZE, max_model_len=512)
        for arch, (d, _) in tiny_checkpoints.items()
    }
    yield llms
    for llm in llms.values():
        llm.close()


@pytest.fixture(scope="module")
def references(tiny_checkpoints, prompts):
    return {arch: [hf_greedy(ref, p, NEW_TOKENS) for p in prompts] for arch, (_, ref) in tiny_checkpoints.items()}


def _check(ref_model, prompts, outs, refs, label):
    notes = []
    for p, o, r in zip(prompts, outs, refs):
        assert o.prompt_token_ids == p
        (seq,) = o.outputs
        assert seq.finish_reason == "length"
        note = assert_greedy_match(ref_model, p, seq.token_ids, r, f"{label} (prompt len {len(p)})")
        if note:
            notes.append(note)
    if notes:
        print("\n".join(notes))


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def test_checkpoints_have_the_features_under_test(tiny_checkpoints):
    import json
    from pathlib import Path

    llama_dir, llama = tiny_checkpoints["llama"]
    qwen_dir, qwen = tiny_checkpoints["qwen2"]
    llama_cfg = json.loads((Path(llama_dir) / "config.json").read_text())
    qwen_cfg = json.loads((Path(qwen_dir) / "config.json").read_text())
    assert llama_cfg["architectures"] == ["LlamaForCausalLM"]
    assert qwen_cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert llama_cfg["num_key_value_heads"] < llama_cfg["num_attention_heads"]
    assert llama_cfg["tie_word_embeddings"] is False
    assert llama.config.rope_parameters["rope_type"] == "llama3"
    assert list(Path(llama_dir).glob("*.safetensors")) and list(Path(qwen_dir).glob("*.safetensors"))
    assert not torch.equal(llama.lm_head.weight, llama.model.embed_tokens.weight)
    assert qwen.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0


def test_llama3_rope_scaling_changes_the_reference(tiny_checkpoints, prompts):
    """Guards the comparison: without its llama3 scaling the same weights give other logits, so parity
    below really checks that our model applies the scaling."""
    from transformers import AutoModelForCausalLM

    d, ref = tiny_checkpoints["llama"]
    unscaled_cfg = tiny_hf_config("llama", ref.config.vocab_size)
    unscaled_cfg.rope_parameters = {"rope_type": "default", "rope_theta": LLAMA3_ROPE["rope_theta"]}
    unscaled = AutoModelForCausalLM.from_config(unscaled_cfg, dtype=torch.float32).eval()
    unscaled.load_state_dict(ref.state_dict())
    ids = torch.tensor([prompts[-1]])
    with torch.no_grad():
        a, b = ref(ids).logits[0, -1], unscaled(ids).logits[0, -1]
    assert (a - b).abs().max() > 0.1


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_one_at_a_time(arch, engines, tiny_checkpoints, prompts, references):
    outs = [engines[arch].generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    _check(tiny_checkpoints[arch][1], prompts, outs, references[arch], f"{arch} solo")


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_in_one_batch(arch, engines, tiny_checkpoints, prompts, references):
    llm = engines[arch]
    steps_before = llm.engine.stats().num_steps
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    # together, not one after another (which would take len(prompts) * NEW_TOKENS steps)
    assert llm.engine.stats().num_steps - steps_before <= NEW_TOKENS + 2
    _check(tiny_checkpoints[arch][1], prompts, outs, references[arch], f"{arch} batched")


def test_references_are_not_trivial(references):
    for refs in references.values():
        assert len({tuple(r) for r in refs}) == len(refs)
        assert all(len(set(r)) > 2 for r in refs)


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_features_are_transformers_hidden_states(arch, engines, tiny_checkpoints, prompts):
    """An EAGLE-3 head's features: the hidden states after chosen decoder layers, as `target_features`
    (training) and the model's forward (serving) return them, are transformers' decoder-layer outputs."""
    from sluice.spec.train import target_features

    model = engines[arch].engine.local_core.executor.runner.model
    _, ref = tiny_checkpoints[arch]
    layers = [0, ref.config.num_hidden_layers - 1]
    p = prompts[-1]
    (feats,) = target_features(model, [p], torch.device("cpu"), progress=False, aux_layers=layers)
    # each decoder layer's output (transformers' hidden_states holds the last one after the final norm)
    outs = {}
    hooks = [
        ref.model.layers[i].register_forward_hook(
            lambda m, a, o, i=i: outs.__setitem__(i, o[0] if isinstance(o, tuple) else o)
        )
        for i in layers
    ]
    try:
        with torch.no_grad():
            final = ref(torch.tensor([p]), output_hidden_states=True).hidden_states[-1]
    finally:
        for hook in hooks:
            hook.remove()
    h = ref.config.hidden_size
    assert feats.shape == (len(p), 3 * h)
    torch.testing.assert_close(feats[:, :h], final[0], atol=1e-4, rtol=1e-4)
    for j, i in enumerate(layers, 1):
        torch.testing.assert_close(feats[:, j * h : (j + 1) * h], outs[i][0], atol=1e-4, rtol=1e-4)
