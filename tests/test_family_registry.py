"""The registry of issue 38's dense families: every architecture resolves to its class, the unknown one is one
line naming all of them, and the named dummy shapes build the real models' structure (on the meta device)."""

from __future__ import annotations

import pytest
import torch
from sluice.core.models.errors import ModelLoadError

FAMILIES = {
    "MistralForCausalLM": "mistral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}


def test_each_family_is_registered_by_its_architecture():
    from sluice.core.models.registry import MODEL_REGISTRY, model_class_for
    from transformers import PretrainedConfig

    for arch, module in FAMILIES.items():
        cls = model_class_for(PretrainedConfig(architectures=[arch]))
        assert cls is MODEL_REGISTRY[arch] and cls.__name__ == arch and cls.__module__.endswith(f".{module}")


def test_unknown_architecture_is_one_line_naming_every_supported_one(tmp_path):
    from sluice.core.models.loader import resolve_model
    from sluice.core.models.registry import MODEL_REGISTRY
    from transformers import LlamaConfig

    LlamaConfig(architectures=["FalconForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and "FalconForCausalLM" in msg
    assert set(FAMILIES) <= set(MODEL_REGISTRY) and all(arch in msg for arch in MODEL_REGISTRY)


@pytest.mark.parametrize(
    ("shape", "arch", "billions"),
    [("qwen3-8b", "Qwen3ForCausalLM", 8.19), ("gemma2-9b", "Gemma2ForCausalLM", 9.24)],
)
def test_named_dummy_shapes_are_the_real_models(shape, arch, billions):
    """Parameter counts of the released models (Qwen3-8B: 8.19 B; Gemma-2-9B: 9.24 B), their head sizes, and
    Gemma 2's alternating 4096-key windows and soft-caps."""
    from sluice.core.models.loader import resolve_model
    from sluice.core.models.registry import model_class_for

    source = resolve_model(f"dummy:{shape}")
    cls = model_class_for(source.config)
    assert cls.__name__ == arch and source.weights_dir is None
    with torch.device("meta"):
        model = cls(source.config, max_position=256)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == billions
    attn = [layer.self_attn for layer in model.model.layers]
    if shape == "gemma2-9b":
        assert model.head_dim == 256 and [a.sliding_window for a in attn[:4]] == [4096, 0, 4096, 0]
        assert attn[0].softcap == 50.0 and model.final_softcap == 30.0
    else:
        assert model.head_dim == 128 and hasattr(attn[0], "q_norm") and not any(a.sliding_window for a in attn)
