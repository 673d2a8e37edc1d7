import json

import pytest
from sluice.app.bench import datasets as ds
from sluice.app.bench.datasets import (
    BenchRequest,
    iter_json_array_items,
    load_truncated_json_array,
    sample_random,
    sample_sharegpt,
    split_indices,
)


def _word_tokenizer(text: str) -> list[int]:
    """A stand-in tokenizer: one token per whitespace-separated word (ids from the word lengths)."""
    return [len(w) for w in text.split()]


# ------------------------------------------------------------------------------------------------ decoder


def test_decoder_complete_array():
    items = [{"a": 1}, [1, 2], "x", 3.5, None]
    assert list(iter_json_array_items(json.dumps(items, indent=2))) == items
    assert list(iter_json_array_items("[]")) == []
    assert list(iter_json_array_items(" [ ] ")) == []


def test_decoder_truncated_file(tmp_path):
    items = [{"id": str(i), "conversations": [{"from": "human", "value": "q [,]" * i}]} for i in range(10)]
    texts = [json.dumps(it) for it in items]
    full = "[\n" + ",\n".join(texts) + "\n]"
    ends = []  # offset just past each item
    pos = 2
    for t in texts:
        ends.append(pos + len(t))
        pos += len(t) + 2
    path = tmp_path / "cut.json"
    for cut in range(1, len(full) + 1, 7):
        path.write_text(full[:cut])
        assert load_truncated_json_array(path) == items[: sum(e <= cut for e in ends)], cut
    path.write_text(full)
    assert load_truncated_json_array(path) == items
    path.write_text(full[: full.index('"id": "5"')])  # cut inside item 5
    assert load_truncated_json_array(path) == items[:5]


def test_decoder_rejects_non_array():
    with pytest.raises(ValueError):
        list(iter_json_array_items('{"a": 1}'))


def test_sharegpt_file_counts():
    convs = ds.load_sharegpt_conversations()
    assert len(convs) == 17_671
    assert sum(len(c["conversations"]) >= 2 for c in convs) == 17_400
    multi = ds.sharegpt_conversations()
    assert len(multi) == 17_400 and all(isinstance(t, str) for t in multi[0])


def test_split_is_deterministic_and_disjoint():
    n = 17_671
    train, held = split_indices(n, "train"), split_indices(n, "heldout")
    assert len(train) + len(held) == n and train.stop == held.start
    assert len(held) == round(n * 0.05)
    assert list(split_indices(n, "all")) == list(range(n))
    with pytest.raises(ValueError):
        split_indices(n, "test")


# ------------------------------------------------------------------------------------------------ sampling


def test_sharegpt_sampling_rules_and_determinism():
    reqs = sample_sharegpt(_word_tokenizer, 200, seed=0)
    assert len(reqs) == 200
    for r in reqs:
        p = len(r.prompt_token_ids)
        assert p >= 4 and r.output_len >= 4
        assert p <= 1024 and p + r.output_len <= 2048
        assert r.prompt_token_ids == _word_tokenizer(r.prompt_text)
    again = sample_sharegpt(_word_tokenizer, 200, seed=0)
    assert [(r.prompt_text, r.output_len) for r in again] == [(r.prompt_text, r.output_len) for r in reqs]
    other = sample_sharegpt(_word_tokenizer, 200, seed=1)
    assert [r.prompt_text for r in other] != [r.prompt_text for r in reqs]
    # a smaller sample is the prefix of a larger one (lazy, same shuffle)
    assert [r.prompt_text for r in sample_sharegpt(_word_tokenizer, 50)] == [r.prompt_text for r in reqs[:50]]


def test_sharegpt_sampling_synthetic_filters():
    convs = [
        ["a b c d", "w x y z"],  # kept (4, 4)
        ["a b c", "w x y z"],  # prompt too short
        ["a b c d", "w x y"],  # output too short
        ["a " * 20, "b " * 20],  # prompt too long for max_prompt_len=10
        ["a " * 8, "b " * 8],  # total 16 > max_total_len=12
        ["only one turn"],  # one turn: never sampled
        ["a b c d e", "v w x y z"],  # kept (5, 5)
    ]
    got = sample_sharegpt(_word_tokenizer, 2, seed=0, conversations=convs, max_prompt_len=10, max_total_len=12)
    assert sorted((len(r.prompt_token_ids), r.output_len) for r in got) == [(4, 4), (5, 5)]
    with pytest.raises(ValueError):
        sample_sharegpt(_word_tokenizer, 3, conversations=convs, max_prompt_len=10, max_total_len=12)
    fixed = sample_sharegpt(_word_tokenizer, 2, conversations=convs, fixed_output_len=4, max_prompt_len=10)
    assert all(r.output_len == 4 for r in fixed)


def test_sharegpt_sampling_lazy_tokenization():
    calls = []

    def counting(text):
        calls.append(text)
        return _word_tokenizer(text)

    sample_sharegpt(counting, 8, seed=0)
    assert len(calls) < 100  # only a handful of the 17,400 conversations were tokenized


def test_sharegpt_heldout_split():
    held = sample_sharegpt(_word_tokenizer, 20, split="heldout")
    held_prompts = {t[0] for t in ds.sharegpt_conversations("heldout")}
    assert len(held) == 20 and all(r.prompt_text in held_prompts for r in held)
    n_train, n_held = len(ds.sharegpt_conversations("train")), len(ds.sharegpt_conversations("heldout"))
    assert n_train + n_held == 17_400 and 0 < n_held < n_train


# ------------------------------------------------------------------------------------------------ random


def test_random_dataset_shape_and_seed():
    reqs = sample_random(5, input_len=7, output_len=3, vocab_size=100, seed=0)
    assert len(reqs) == 5 and all(isinstance(r, BenchRequest) for r in reqs)
    assert all(len(r.prompt_token_ids) == 7 and r.output_len == 3 for r in reqs)
    assert all(0 <= t < 100 for r in reqs for t in r.prompt_token_ids)
    assert all(r.prompt_text is None for r in reqs)
    assert [r.prompt_token_ids for r in sample_random(5, 7, 3, 100, seed=0)] == [r.prompt_token_ids for r in reqs]
    assert [r.prompt_token_ids for r in sample_random(5, 7, 3, 100, seed=1)] != [r.prompt_token_ids for r in reqs]
    with pytest.raises(ValueError):
        sample_random(1, 0, 3, 100)
