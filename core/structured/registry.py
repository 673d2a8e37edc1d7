"""The grammar backends by name: llguidance (the default); room for an optional xgrammar."""

from __future__ import annotations

from sluice.core.errors import InvalidStructuredOutput
from sluice.core.structured.backend import GrammarBackend

DEFAULT_BACKEND = "llguidance"


def make_backend(name: str, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]) -> GrammarBackend:
    """The grammar backend ``name`` over a Hugging Face tokenizer (a fast one)."""
    if name == "llguidance":
        from sluice.core.structured.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(hf_tokenizer, vocab_size, eos_token_ids)
    raise InvalidStructuredOutput(f"unknown grammar backend {name!r} (available: llguidance)", param=None)


def load_backend(name: str, tokenizer_dir: str, vocab_size: int, eos_token_ids: list[int]) -> GrammarBackend:
    """`make_backend` over the tokenizer in ``tokenizer_dir`` (the engine core's side, which holds no tokenizer
    of its own)."""
    from transformers import AutoTokenizer

    return make_backend(name, AutoTokenizer.from_pretrained(tokenizer_dir), vocab_size, eos_token_ids)
