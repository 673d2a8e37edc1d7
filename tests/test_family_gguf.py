"""GGUF round trips for the dense families whose GGUF both the ``gguf`` package writes and transformers reads
(its ``GGUF_CONFIG_MAPPING``): Gemma 2 (norms stored as ``1 + w``, the sliding window as GGUF metadata) and
Phi-3 (fused ``attn_qkv`` and ``ffn_up``). The ``gguf`` package writes transformers' tiny random model as
llama.cpp lays it out (`tests/family_gguf.py`), sluice converts it once through transformers' GGUF reader
and serves it: the greedy tokens are the original model's, for prompts longer than the window."""

from __future__ import annotations

import pytest
import torch
from sluice.core import LLM

from tests.family_gguf import VOCAB_SIZE, write_gguf
from tests.family_parity import GREEDY, NEW_TOKENS, check_greedy
from tests.helpers import hf_greedy, save_tiny_hf_model

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def _config(arch: str, vocab_size: int):
    """Values GGUF metadata carries, the rest at the family's defaults (transformers reads those back)."""
    from transformers import Gemma2Config, Phi3Config

    if arch == "gemma2":
        return Gemma2Config(**TINY, vocab_size=vocab_size, head_dim=16, sliding_window=24)
    return Phi3Config(**TINY, vocab_size=vocab_size, pad_token_id=0)


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_gguf_round_trip_gives_the_original_models_tokens(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    ref = save_tiny_hf_model(_config(arch, VOCAB_SIZE), tmp_path / "hf", seed=11)
    path = write_gguf(ref, arch, tmp_path / f"tiny-{arch}.gguf")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB_SIZE - 1, (n,), generator=g).tolist() for n in (30, 60)]
    refs = [hf_greedy(ref, p, NEW_TOKENS) for p in prompts]
    with LLM(model=str(path), device="cpu", num_kv_blocks=48, block_size=16, max_model_len=256) as llm:
        config = llm.engine.local_core.executor.runner.model.config
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert config.architectures == [ref.config.architectures[0]]
    if arch == "gemma2":  # the window came through the GGUF's metadata
        assert config.sliding_window == 24 and config.layer_types == ["sliding_attention", "full_attention"]
    check_greedy(ref, prompts, outs, refs, f"{arch} from GGUF")
    assert torch.equal(torch.tensor([len(o.outputs[0].token_ids) for o in outs]), torch.tensor([NEW_TOKENS] * 2))
