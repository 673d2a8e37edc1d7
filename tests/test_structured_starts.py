"""`GrammarStarts`: several independent starts per grammar, forked in turn, so that a step's rows do not all
share one start's locked state (llguidance's forks share its lexer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sluice.core.models.loader import default_tokenizer_dir
from sluice.core.sampling_params import StructuredOutputsParams
from sluice.core.structured.matchers import GrammarRows
from sluice.core.structured.registry import load_backend
from sluice.core.structured.starts import GrammarStarts


class Start:
    def __init__(self, name: str) -> None:
        self.name = name

    def fork(self) -> tuple[str, str]:
        return ("fork of", self.name)


def test_forks_wait_for_a_full_set_then_take_the_starts_in_turn():
    starts = GrammarStarts(per_grammar=3)
    assert starts.fork("g") is None
    for name in ("a", "b"):
        starts.add("g", Start(name))
    assert starts.fork("g") is None  # two of three: the caller compiles a third
    starts.add("g", Start("c"))
    starts.add("g", Start("d"))  # past the set: not kept
    assert starts.count("g") == 3
    forks = [starts.fork("g") for _ in range(6)]
    taken = [fork[1] for fork, _ in forks]
    assert sorted(taken) == ["a", "a", "b", "b", "c", "c"]
    assert all(taken[i] != taken[i + 1] for i in range(5))
    families = {name: family for (_, name), family in forks}  # a start's forks are its family
    assert len(set(families.values())) == 3 and all(families[f[1]] == family for f, family in forks)


def test_the_least_recently_used_grammar_goes_first():
    starts = GrammarStarts(per_grammar=1)
    for i in range(64):
        starts.add(f"g{i}", Start(str(i)))
    starts.fork("g0")  # used: now the most recent
    starts.add("g64", Start("64"))
    assert starts.count("g0") == 1 and starts.count("g1") == 0 and starts.count("g64") == 1


@pytest.fixture(scope="module")
def backend():
    return load_backend("llguidance", str(default_tokenizer_dir()), 49152, [2])


def test_a_grammars_first_requests_compile_their_own_starts_and_later_ones_fork(backend, monkeypatch):
    monkeypatch.setenv("SLUICE_GRAMMAR_THREADS", "3")
    assert backend.independent_starts == 3
    rows = GrammarRows(lambda: backend, 49152, 8, torch.device("cpu"))
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}}})
    source = backend.grammar_of(spec).source
    for i in range(8):
        rows.add(f"r{i}", spec, [])
        rows.fill([f"r{i}"], np.array([0]))  # waits for its compile, if it had one
    assert rows.starts.count(source) == 3
    ids = [f"r{i}" for i in range(8)]
    assert len(set(rows.families.values())) == 3  # the three starts' families (a compiling request's own too)
    mask, _ = rows.fill(ids, np.arange(8))
    host = mask.numpy()
    assert (host == host[0]).all() and host[0].any()  # every row at the grammar's start, whichever start it came from


def test_a_steps_rows_reach_the_backend_ordered_by_family_and_each_mask_lands_in_its_row(backend, monkeypatch):
    monkeypatch.setenv("SLUICE_GRAMMAR_THREADS", "2")
    rows = GrammarRows(lambda: backend, 49152, 8, torch.device("cpu"))
    digit = StructuredOutputsParams(regex="[0-9]+")
    letter = StructuredOutputsParams(regex="[a-z]+")
    ids = [f"r{i}" for i in range(8)]
    for i, rid in enumerate(ids):  # two grammars, two starts each: four families, interleaved over the rows
        rows.add(rid, digit if i % 2 else letter, [])
        rows.fill([rid], np.array([0]))
    seen: list[int] = []
    fill = backend.fill_bitmasks

    def spy(pairs, host):
        seen.extend(i for _, i in pairs)
        fill(pairs, host)

    monkeypatch.setattr(backend, "fill_bitmasks", spy)
    mask, _ = rows.fill(ids, np.arange(8))
    families = [rows.families[ids[i]] for i in seen]
    assert sorted(seen) == list(range(8)) and families == sorted(families) and len(set(families)) == 4
    host = mask.numpy()
    for i in range(8):  # each row's mask is its own grammar's, wherever the order put it
        assert (host[i] == host[i % 2]).all()
    assert not (host[0] == host[1]).all()


def test_mask_threads_follow_the_usable_cores():
    from sluice.core.structured.llguidance_backend import mask_threads

    # two cores kept for the step's thread and the event loops, at least one thread, at most sixteen
    assert [mask_threads(c) for c in (1, 2, 3, 4, 16, 64)] == [1, 1, 1, 2, 14, 16]


def test_the_warm_up_masks_nothing_and_the_first_fill_after_it_is_its_own(backend):
    rows = GrammarRows(lambda: backend, 49152, 4, torch.device("cpu"))
    logits = torch.randn(2, 49152)
    before = logits.clone()
    rows.warm_up(logits)  # the mask kernel's first run
    assert torch.equal(logits, before)
    rows.add("r", StructuredOutputsParams(regex="[0-9]+"), [])
    rows.mask_logits(logits, ["r"], np.array([1]))
    assert torch.equal(logits[0], before[0])  # the fill's first mask row is the request's, for row 1 only
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    tok = backend.tokenizer
    assert allowed and all(tok.decode_bytes([t]).isdigit() for t in allowed)
