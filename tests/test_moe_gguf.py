"""A Qwen3-MoE GGUF round trip: transformers' own tiny `Qwen3MoeForCausalLM` written as a llama.cpp ``qwen3moe`` GGUF
(fp32 tensors, its experts as ``ffn_{gate,up,down}_exps`` stacks), converted by sluice through transformers' GGUF
reader, loads and gives the reference logits. Mixtral has no GGUF path here: llama.cpp writes it as ``llama`` with
expert tensors, which transformers' reader does not take.

The GGUF carries a byte-level tokenizer of 257 tokens (the default model's 49,152 make transformers' reader take
tens of seconds); the weights are what is under test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import save_tiny_hf_model
from tests.test_moe import LOGITS_ATOL, moe_config
from tests.test_qwen3 import _prefill_logits

gguf = pytest.importorskip("gguf")

ARCH = "qwen3moe"
# transformers name (per layer after ``model.layers.{i}.``) -> llama.cpp name (after ``blk.{i}.``)
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}


def _byte_tokens() -> tuple[list[str], list[str]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values()) + ["\u0120t"], ["\u0120 t"]  # a GGUF's merges may not be empty


def write_qwen3_moe_gguf(ref, path: Path) -> None:
    from gguf import GGUFValueType as T

    cfg = ref.config
    w = gguf.GGUFWriter(str(path), ARCH)
    u32 = {
        "context_length": cfg.max_position_embeddings,
        "block_count": cfg.num_hidden_layers,
        "feed_forward_length": cfg.intermediate_size,
        "embedding_length": cfg.hidden_size,
        "expert_count": cfg.num_experts,
        "expert_used_count": cfg.num_experts_per_tok,
        "expert_feed_forward_length": cfg.moe_intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": cfg.head_dim,
        "attention.value_length": cfg.head_dim,
    }
    for key, value in u32.items():
        w.add_key_value(f"{ARCH}.{key}", value, T.UINT32)
    w.add_key_value(f"{ARCH}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps, T.FLOAT32)
    w.add_key_value(f"{ARCH}.rope.freq_base", cfg.rope_parameters["rope_theta"], T.FLOAT32)
    tokens, merges = _byte_tokens()
    w.add_key_value("tokenizer.ggml.model", "gpt2", T.STRING)
    w.add_key_value("tokenizer.ggml.tokens", tokens, T.ARRAY, sub_type=T.STRING)
    w.add_key_value("tokenizer.ggml.token_type", [1] * len(tokens), T.ARRAY, sub_type=T.INT32)
    w.add_key_value("tokenizer.ggml.merges", merges, T.ARRAY, sub_type=T.STRING)
    w.add_key_value("tokenizer.ggml.eos_token_id", 0, T.UINT32)
    sd = ref.state_dict()
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    names["lm_head.weight"] = "output.weight"
    for i in range(cfg.num_hidden_layers):
        names.update({f"model.layers.{i}.{a}": f"blk.{i}.{b}" for a, b in LAYER_NAMES.items()})
    for hf, name in names.items():
        w.add_tensor(name, sd[hf].numpy())
    for i in range(cfg.num_hidden_layers):  # llama.cpp keeps gate and up as two stacks
        gate, up = sd[f"model.layers.{i}.mlp.experts.gate_up_proj"].chunk(2, dim=1)
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", gate.contiguous().numpy())
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", up.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_qwen3_moe_gguf_loads_and_gives_the_reference_logits(tmp_path):
    from sluice.core.models.loader import load_model, resolve_model

    vocab = len(_byte_tokens()[0])
    # GGUF has no mlp_only_layers, and llama.cpp renormalizes the top-k weights (transformers' reader sets it)
    cfg = moe_config("qwen3_moe", vocab, mlp_only_layers=[], num_hidden_layers=2, norm_topk_prob=True)
    ref = save_tiny_hf_model(cfg, tmp_path / "hf", seed=7)
    path = tmp_path / "tiny-qwen3-moe.gguf"
    write_qwen3_moe_gguf(ref, path)
    source = resolve_model(str(path), tmp_path / "cache")
    assert source.gguf_file == str(path)
    assert source.config.moe_intermediate_size == cfg.moe_intermediate_size  # not transformers' default of 768
    model = load_model(source, torch.float32, torch.device("cpu"), max_position=512)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    ids = [int(t) for t in torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    assert (_prefill_logits(model, ids) - want).abs().max().item() < LOGITS_ATOL
