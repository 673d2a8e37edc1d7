"""The host's cost of `GrammarRows.fill` outside llguidance (its per-row bookkeeping and the check for rows that
allow no token), at R rows of a 128,256-id vocabulary, the backend's fill a no-op; and the empty-row check alone
against reading every row whole (the check before `matchers.empty_rows`), in one run.

    PYTHONPATH=$(scripts/namespace_path.sh) python scripts/grammar_fill_overhead.py --rows 30 256
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[30, 256])
    p.add_argument("--repeats", type=int, default=300)
    ns = p.parse_args()
    print("rows  fill outside llguidance, us  empty-row check: screened / every row whole, us")
    for r in ns.rows:
        fill, screened, whole = _figures(r, max(ns.rows), ns.repeats)
        print(f"{r:4d}  {fill:27.1f}  {screened:8.1f} / {whole:.1f}")


if __name__ == "__main__":
    main()
