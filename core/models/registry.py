"""Which model class serves which ``config.architectures`` entry, and the named dummy shapes."""

from __future__ import annotations

from sluice.core.models.default_model import DEFAULT_MODEL  # noqa: F401  (re-exported)
from sluice.core.models.errors import ModelLoadError
from sluice.core.models.gemma2 import Gemma2ForCausalLM
from sluice.core.models.gemma3 import Gemma3ForCausalLM
from sluice.core.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from sluice.core.models.mistral import MistralForCausalLM
from sluice.core.models.mixtral import MixtralForCausalLM
from sluice.core.models.phi3 import Phi3ForCausalLM
from sluice.core.models.qwen3 import Qwen3ForCausalLM
from sluice.core.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}

# Random-weight models in real shapes (config keyword arguments; LlamaConfig unless a shape names its
# ``model_type`` and ``architectures``), for benchmarks and tests.
DUMMY_SHAPES: dict[str, dict] = {
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=8192,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
    # mistralai/Mixtral-8x7B-v0.1's config.json
    "mixtral-8x7b": dict(
        model_type="mixtral",
        architectures=["MixtralForCausalLM"],
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        num_local_experts=8,
        num_experts_per_tok=2,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        sliding_window=None,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
    ),
    # Qwen/Qwen3-30B-A3B's config.json
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=49152,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
    # Qwen/Qwen3-8B's config.json
    "qwen3-8b": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
    # google/gemma-2-9b's config.json
    "gemma2-9b": dict(
        model_type="gemma2",
        architectures=["Gemma2ForCausalLM"],
        hidden_size=3584,
        intermediate_size=14336,
        num_hidden_layers=42,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        vocab_size=256000,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
}


def model_class_for(config) -> type[LlamaForCausalLM]:
    """The class serving the first of ``config.architectures`` that is registered; else a one-line
    `ModelLoadError` naming the architectures that are."""
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    named = ", ".join(archs) if archs else "(none named in the config)"
    raise ModelLoadError(f"unsupported architecture {named}; sluice serves: {', '.join(MODEL_REGISTRY)}")
