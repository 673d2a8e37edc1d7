"""The host's cost of `GrammarRows.fill` outside llguidance (its per-row bookkeeping and the check for rows that
allow no token), at R rows of a 128,256-id vocabulary, the backend's fill a no-op; and the empty-row check alone
against reading every row whole (the check before `matchers.empty_rows`), in one run. ``--walk STEPS``: the same
two checks on llguidance's real masks (`sluice bench structured`'s schema, the default model's tokenizer), each row
taking a random allowed token a step, and the share of rows the screen leaves to be read whole.

    PYTHONPATH=$(scripts/namespace_path.sh) python scripts/grammar_fill_overhead.py --rows 30 256 [--walk 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from sluice.core.sampling_params import StructuredOutputsParams
from sluice.core.structured.backend import CompiledGrammar
from sluice.core.structured.matchers import GrammarRows, empty_rows

VOCAB = 128_256


class _Matcher:
    is_terminated = False
    error = None

    def fork(self):
        return _Matcher()


class _Backend:
    """Matchers that fill nothing: the masks stay all-allowed, as the buffers start."""

    independent_starts = 1

    def grammar_of(self, spec):
        return CompiledGrammar("g", "json")

    def matcher(self, grammar):
        return _Matcher()

    def fill_bitmasks(self, rows, host):
        pass


def _us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _figures(r: int, max_rows: int, repeats: int) -> tuple[float, float, float]:
    """At ``r`` rows: the fill outside llguidance, the screened empty-row check, every row read whole (us)."""
    backend = _Backend()
    gr = GrammarRows(lambda: backend, VOCAB, max_rows, torch.device("cpu"))
    rids = [f"r{i}" for i in range(r)]
    for rid in rids:
        gr.add(rid, StructuredOutputsParams(json={"type": "object"}), [])
    rows = np.arange(r)
    host = gr.fill(rids, rows)[0].numpy()
    return (
        _us(lambda: gr.fill(rids, rows), repeats),
        _us(lambda: empty_rows(host), repeats),
        _us(lambda: np.flatnonzero(host.view(np.uint32).max(axis=1) == 0), repeats),
    )


def _walk(r: int, steps: int, repeats: int) -> tuple[float, float, float]:
    """Over ``steps`` steps of real masks at ``r`` rows: the share of rows read whole, the screened check and every
    row read whole (us, medians over the steps)."""
    from sluice.app.bench.structured import LONG_SCHEMA
    from sluice.core.models.loader import default_tokenizer_dir
    from sluice.core.structured.registry import load_backend

    vocab = 49152  # the default model's tokenizer, whose ids the masks cover
    backend = load_backend("llguidance", str(default_tokenizer_dir()), vocab, [2])
    spec = StructuredOutputsParams(json=LONG_SCHEMA)
    gr = GrammarRows(lambda: backend, vocab, r, torch.device("cpu"))
    rids, rows, rng = [f"r{i}" for i in range(r)], np.arange(r), np.random.default_rng(0)
    for rid in rids:
        gr.add(rid, spec, [])
        gr.fill([rid], np.array([0]))
    whole_rows, screened, whole = 0, [], []
    for _ in range(steps):
        host = gr.fill(rids, rows)[0].numpy()
        whole_rows += int((host[:, :32].view(np.uint32).max(axis=1) == 0).sum())
        screened.append(_us(lambda h=host: empty_rows(h), repeats))
        whole.append(_us(lambda h=host: np.flatnonzero(h.view(np.uint32).max(axis=1) == 0), repeats))
        bits = np.unpackbits(host.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        gr.accept_rows(rids, [int(rng.choice(np.flatnonzero(b))) for b in bits], rows)
    return whole_rows / (r * steps), statistics.median(screened), statistics.median(whole)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[30, 256])
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--walk", type=int, default=0, help="steps of real masks to time the checks on as well")
    ns = p.parse_args()
    print("rows  fill outside llguidance, us  empty-row check: screened / every row whole, us")
    for r in ns.rows:
        fill, screened, whole = _figures(r, max(ns.rows), ns.repeats)
        print(f"{r:4d}  {fill:27.1f}  {screened:8.1f} / {whole:.1f}")
    if ns.walk:
        print("real masks: rows  read whole  empty-row check: screened / every row whole, us")
        for r in ns.rows:
            share, screened, whole = _walk(r, ns.walk, 20)
            print(f"            {r:4d}  {share:9.0%}  {screened:8.1f} / {whole:.1f}")


if __name__ == "__main__":
    main()
