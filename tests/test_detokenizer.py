"""`IncrementalDetokenizer`: the deltas, concatenated, are exactly ``tokenizer.decode(all ids)``, also when
multi-byte characters (emoji, CJK, accents) are split over several byte-level tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sluice.core.frontend.tokenizer import IncrementalDetokenizer

TEXTS = [
    "Café naïve — déjà vu, Ångström, façade.",
    "東京タワーは高いです。中文测试：你好，世界！",
    "Party 🎉👩‍👩‍👧 time 😀😀 with 🇫🇷 flags",
    "mixed: ñandú 東京 🎉 e\u0301 (combining accent) end",
]


def _run(tokenizer, prompt_ids, ids, chunks, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    deltas, i = [], 0
    for n in chunks:
        deltas.append(detok.add(ids[i : i + n]))
        i += n
    assert i == len(ids)
    assert detok.text == "".join(deltas)
    return deltas


def test_texts_really_split_characters_across_tokens(default_tokenizer):
    """Guards the cases: each text has a token that alone decodes to an incomplete character."""
    for text in TEXTS[1:3]:
        ids = default_tokenizer.encode(text, add_special_tokens=False)
        assert any("\ufffd" in default_tokenizer.decode([t]) for t in ids), text


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "Say it: ", "前文 🎉"])
def test_one_token_at_a_time(default_tokenizer, text, prompt):
    prompt_ids = default_tokenizer.encode(prompt, add_special_tokens=False)
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    deltas = _run(default_tokenizer, prompt_ids, ids, [1] * len(ids))
    assert "".join(deltas) == default_tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)  # a split character is held back, never shown broken


@pytest.mark.parametrize("text", TEXTS)
def test_uneven_chunks(default_tokenizer, text):
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    chunks, left, n = [], len(ids), 1
    while left:
        chunks.append(min(n, left))
        left -= chunks[-1]
        n = n % 4 + 1
    assert "".join(_run(default_tokenizer, [1, 2, 3], ids, chunks)) == default_tokenizer.decode(ids)


def test_special_tokens(default_tokenizer):
    tok = default_tokenizer
    ids = tok.encode("Hi 🎉", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    ones = [1] * len(ids)
    assert "".join(_run(tok, [], ids, ones, skip_special_tokens=True)) == tok.decode(ids, skip_special_tokens=True)
    shown = "".join(_run(tok, [], ids, ones, skip_special_tokens=False))
    assert shown == tok.decode(ids, skip_special_tokens=False) and shown.endswith("<|im_end|>")


def test_ids_past_the_tokenizer_carry_no_text(default_tokenizer):
    """Random-weight models may sample ids the tokenizer lacks."""
    tok = default_tokenizer
    ids = tok.encode("東京 ok", add_special_tokens=False)
    mixed = ids[:1] + [len(tok) + 5] + ids[1:]
    assert "".join(_run(tok, [], mixed, [1] * len(mixed))) == tok.decode(ids)


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(
        alphabet=st.sampled_from(list("aé ñ東京文字🎉😀👩\u200d🇫🇷—.\n") + ["\u0301"]),
        min_size=1,
        max_size=24,
    ),
    prompt=st.sampled_from(["", "x", "🎉", "東"]),
)
def test_any_text_round_trips(default_tokenizer, text, prompt):
    prompt_ids = default_tokenizer.encode(prompt, add_special_tokens=False)
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    assert "".join(_run(default_tokenizer, prompt_ids, ids, [1] * len(ids))) == default_tokenizer.decode(ids)
