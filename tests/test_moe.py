"""Mixture-of-experts families against transformers on tiny random checkpoints that transformers' own
`Qwen3MoeForCausalLM` and `MixtralForCausalLM` write (fp32, CPU).

Qwen3-MoE: three layers, the middle one dense (``mlp_only_layers``), 8 experts of which 3 per token, renormalized;
Mixtral: 4 experts, 2 per token. Every parameter is random (router and norms included), so a weight loaded into the
wrong expert or half shows. ``save_pretrained`` writes one tensor per expert and projection (Mixtral's under
``block_sparse_moe`` as ``w1/w2/w3``); a checkpoint in transformers' fused in-memory form loads too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sluice.core import LLM, SamplingParams
from sluice.core.models.errors import ModelLoadError

from tests.helpers import assert_greedy_match, hf_greedy, prompt_of_length, save_tiny_hf_model
from tests.test_qwen3 import _prefill_logits

NEW_TOKENS = 32
BLOCK_SIZE = 16
PROMPT_LENS = [1, 17, 40, 70]
LOGITS_ATOL = 1e-4  # fp32 on both sides; sums in another order
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
FAMILIES = ["qwen3_moe", "mixtral"]


def moe_config(family: str, vocab_size: int, **overrides):
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    if family == "qwen3_moe":
        cfg = dict(
            common,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            rms_norm_eps=1e-6,
        )
        return Qwen3MoeConfig(**(cfg | overrides))
    cfg = dict(
        common,
        intermediate_size=48,
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        sliding_window=None,
    )
    return MixtralConfig(**(cfg | overrides))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, default_tokenizer):
    """family -> (model directory, transformers reference model)."""
    out = {}
    for i, family in enumerate(FAMILIES):
        d = tmp_path_factory.mktemp(f"tiny-{family}")
        ref = save_tiny_hf_model(moe_config(family, len(default_tokenizer)), d, default_tokenizer, seed=10 + i)
        out[family] = (str(d), ref)
    return out


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    return [prompt_of_length(default_tokenizer, n, f"Tale {n}:") for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def references(checkpoints, prompts):
    return {f: [hf_greedy(ref, p, NEW_TOKENS) for p in prompts] for f, (_, ref) in checkpoints.items()}


@pytest.fixture(scope="module")
def engines(checkpoints):
    llms = {
        f: LLM(model=d, device="cpu", num_kv_blocks=128, block_size=BLOCK_SIZE) for f, (d, _) in checkpoints.items()
    }
    yield llms
    for llm in llms.values():
        llm.close()


def _load(d: str):
    from sluice.core.models.loader import load_model, resolve_model

    return load_model(resolve_model(d), torch.float32, torch.device("cpu"), max_position=512)


def _check(ref_model, prompts, outs, refs, label):
    for p, o, r in zip(prompts, outs, refs, strict=True):
        (seq,) = o.outputs
        assert len(seq.token_ids) == NEW_TOKENS
        note = assert_greedy_match(ref_model, p, seq.token_ids, r, f"{label} (prompt len {len(p)})")
        if note:
            print(note)


def test_checkpoints_have_the_features_under_test(checkpoints):
    from safetensors import safe_open

    for family, (d, ref) in checkpoints.items():
        with safe_open(str(Path(d) / "model.safetensors"), framework="pt") as f:
            names = list(f.keys())
        per_expert = "mlp.experts.7.up_proj.weight" if family == "qwen3_moe" else "block_sparse_moe.experts.3.w3.weight"
        assert any(n.endswith(per_expert) for n in names), names
        cfg = json.loads((Path(d) / "config.json").read_text())
        assert cfg["architectures"] == [type(ref).__name__]
    qwen = checkpoints["qwen3_moe"][1]
    assert hasattr(qwen.model.layers[1].mlp, "gate_proj") and hasattr(qwen.model.layers[2].mlp, "experts")


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, checkpoints, prompts):
    d, ref = checkpoints[family]
    model = _load(d)
    assert type(model).__name__ == type(ref).__name__
    ids = prompts[-1]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    diff = (_prefill_logits(model, ids) - want).abs().max().item()
    print(f"{family}: max abs logit diff {diff:.2e}")
    assert diff < LOGITS_ATOL


def test_qwen3_moe_without_renormalization_matches(tmp_path, default_tokenizer):
    """``norm_topk_prob`` off: the top-k softmax weights are used as they are (they sum to less than one)."""
    ref = save_tiny_hf_model(moe_config("qwen3_moe", 512, norm_topk_prob=False, mlp_only_layers=[]), tmp_path, seed=5)
    model = _load(str(tmp_path))
    assert not model.model.layers[0].mlp.renormalize
    ids = list(range(100, 140))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    assert (_prefill_logits(model, ids) - want).abs().max().item() < LOGITS_ATOL


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_solo_and_batched(family, engines, checkpoints, prompts, references):
    llm, ref = engines[family], checkpoints[family][1]
    solo = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    _check(ref, prompts, solo, references[family], f"{family} solo")
    steps_before = llm.engine.stats().num_steps
    batched = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.stats().num_steps - steps_before <= NEW_TOKENS + 2  # together, not one after another
    _check(ref, prompts, batched, references[family], f"{family} batched")


def test_references_are_not_trivial(references):
    for refs in references.values():
        assert len({tuple(r) for r in refs}) == len(refs)
        assert all(len(set(r)) > 2 for r in refs)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_prefix_hits_and_preemption_give_the_solo_tokens(family, engines, default_tokenizer):
    """A 32-token budget (prompts prefilled in chunks), a pool of 10 blocks for six requests needing 4 each at
    their end (preemption), and one prompt run twice (its second run reads its blocks from the prefix cache): the
    tokens of each prompt run alone in a roomy engine."""
    d = engines[family].engine.args.model
    few = [prompt_of_length(default_tokenizer, 33 + 3 * i, f"Pool {i}:") for i in range(6)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    solo = [o.outputs[0].token_ids for o in (engines[family].generate([p], params, use_tqdm=False)[0] for p in few)]
    kw = dict(num_kv_blocks=10, block_size=BLOCK_SIZE, max_model_len=128, max_num_batched_tokens=32)
    with LLM(model=d, device="cpu", **kw) as llm:
        first, again = (llm.generate([few[-1]], params, use_tqdm=False)[0] for _ in range(2))
        assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 32
        outs = llm.generate(few, params, use_tqdm=False)
        assert llm.engine.stats().num_preemptions > 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == solo[-1]
    assert [o.outputs[0].token_ids for o in outs] == solo


@pytest.mark.parametrize("family", FAMILIES)
def test_triton_experts_in_the_model_give_the_torch_logits(family, checkpoints, prompts):
    """The grouped-GEMM kernel (the interpreter on the CPU) in place of the torch loop, every MoE layer."""
    pytest.importorskip("triton")
    d, ref = checkpoints[family]
    model = _load(d)
    ids = prompts[2]
    want = _prefill_logits(model, ids)
    moe = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    for m in moe:
        m.experts.use_triton = True
    assert (_prefill_logits(model, ids) - want).abs().max().item() < LOGITS_ATOL


@pytest.mark.parametrize("family", FAMILIES)
def test_the_decode_path_in_the_model_gives_the_torch_logits(family, checkpoints, prompts, monkeypatch):
    """A decode step of one token through the few-token path (router, gate/up and down-sum kernels; the
    interpreter on the CPU) after a prefill: the last position's logits of the torch loop's prefill."""
    pytest.importorskip("triton")
    from sluice.core.models.layers import ForwardContext
    from sluice.kv.attention import AttentionMetadata, allocate_kv_cache, get_attention_backend

    model = _load(checkpoints[family][0])
    ids = prompts[2]
    want = _prefill_logits(model, ids)[-1]
    from sluice.core.models import moe_decode
    from sluice.core.models.moe import SparseMoeBlock

    calls = []
    run = moe_decode.decode_moe
    monkeypatch.setattr(moe_decode, "decode_moe", lambda x, *a: calls.append(x.shape[0]) or run(x, *a))
    for m in model.modules():
        if isinstance(m, SparseMoeBlock):
            m.enable_decode_kernels()
            m.experts.use_triton = True
    n = len(ids)
    blocks = -(-n // BLOCK_SIZE)
    kv = allocate_kv_cache(
        len(model.model.layers), blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim, torch.float32, "cpu"
    )
    table = torch.arange(blocks, dtype=torch.int32)[None]
    backend = get_attention_backend("torch")
    for start, end in ((0, n - 1), (n - 1, n)):  # the prompt less its last token, then that token alone
        q = end - start
        meta = AttentionMetadata(torch.arange(start, end), torch.tensor([0, q], dtype=torch.int32),
                                 torch.tensor([end], dtype=torch.int32), table, q, end, [0, q], [end])  # fmt: skip
        with torch.inference_mode():
            hidden = model(torch.tensor(ids[start:end]), torch.arange(start, end), ForwardContext(meta, kv, backend))
            got = model.compute_logits(hidden)[-1]
    assert calls and set(calls) == {1}  # the decode token's sparse layers, and only it, took the path
    assert (got - want).abs().max().item() < LOGITS_ATOL


def test_fused_expert_tensors_load_like_per_expert_ones(tmp_path, checkpoints, prompts):
    """transformers' in-memory names (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj``), as
    a checkpoint written from its state dict holds them."""
    from safetensors.torch import save_file

    d, ref = checkpoints["mixtral"]
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    for f in Path(d).iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(state, str(tmp_path / "model.safetensors"))
    ids = prompts[2]
    torch.testing.assert_close(_prefill_logits(_load(str(tmp_path)), ids), _prefill_logits(_load(d), ids))


def test_a_missing_expert_is_named(tmp_path, checkpoints):
    from safetensors.torch import load_file, save_file

    d, _ = checkpoints["qwen3_moe"]
    for f in Path(d).iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    state = load_file(str(Path(d) / "model.safetensors"))
    del state["model.layers.2.mlp.experts.5.down_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"missing weights in checkpoint: model\.layers\.2\.mlp\.experts\.5\.down_proj$"
    ):
        _load(str(tmp_path))


def test_two_tensor_parallel_ranks_give_transformers_tokens(checkpoints, prompts, references):
    """Two gloo ranks, each with every expert's half of the intermediate dim (and half the dense MLP's)."""
    d, ref = checkpoints["qwen3_moe"]
    few = [prompts[1], prompts[3]]
    with LLM(model=d, tensor_parallel_size=2, device="cpu", num_kv_blocks=64, block_size=BLOCK_SIZE) as two:
        outs = two.generate(few, GREEDY, use_tqdm=False)
    refs = references["qwen3_moe"]
    _check(ref, few, outs, [refs[1], refs[3]], "qwen3_moe two ranks")


@pytest.mark.parametrize(("shape", "billions"), [("mixtral-8x7b", 46.7), ("qwen3-30b-a3b", 30.5)])
def test_named_dummy_shapes_are_the_real_models(shape, billions):
    from sluice.core.models.loader import resolve_model
    from sluice.core.models.registry import model_class_for

    source = resolve_model(f"dummy:{shape}")
    with torch.device("meta"):
        model = model_class_for(source.config)(source.config, max_position=4096)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.05)


def test_mixtral_with_a_short_sliding_window_is_refused():
    from sluice.core.models.mixtral import MixtralForCausalLM

    with pytest.raises(ModelLoadError, match="sliding window"):
        MixtralForCausalLM(moe_config("mixtral", 256, sliding_window=64), max_position=128)


def test_a_tensor_parallel_rank_takes_its_cut_of_fused_expert_tensors(checkpoints):
    """Rank 1 of 2 from transformers' fused names (what a random-weight TP run's checkpoint also holds): each
    expert's second half of the gate rows, of the up rows and of the down columns."""
    from sluice.core.models.mixtral import MixtralForCausalLM
    from sluice.core.models.parallel import TensorParallel

    _, ref = checkpoints["mixtral"]
    state = ref.state_dict()
    model = MixtralForCausalLM(ref.config, max_position=64, tp=TensorParallel(1, 2))
    model.load_weights(state.items())
    i = ref.config.intermediate_size
    full_gu, full_down = state["model.layers.1.mlp.experts.gate_up_proj"], state["model.layers.1.mlp.experts.down_proj"]
    experts = model.model.layers[1].mlp.experts
    want = torch.cat([full_gu[:, i // 2 : i], full_gu[:, i + i // 2 :]], dim=1)
    assert torch.equal(experts.gate_up_proj.data, want)
    assert torch.equal(experts.down_proj.data, full_down[:, :, i // 2 :])
