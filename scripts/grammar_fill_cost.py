"""The host's cost of one step's grammar mask (`GrammarRows.fill`) at R constrained rows, on the CPU: the whole
`fill`, and llguidance's part alone (`LLExecutor` at 1, 2 and 8 threads or ``--threads``, and row by row in this
thread). Rows follow `sluice bench structured`'s schema; between steps each row takes a random token its mask
allows, so the rows' states differ, as in a real batch (``--warm``: no tokens, the same masks again each step).

    PYTHONPATH=$(scripts/namespace_path.sh) python scripts/grammar_fill_cost.py --rows 64 --steps 100
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
from llguidance import LLExecutor
from sluice.app.bench.structured import LONG_SCHEMA
from sluice.core.models.loader import default_tokenizer_dir
from sluice.core.sampling_params import StructuredOutputsParams
from sluice.core.structured.matchers import GrammarRows
from sluice.core.structured.registry import load_backend

VOCAB = 49152


def walk(backend, spec, ns, fill_rows, starts: int) -> tuple[list[float], list[float]]:
    """One random walk of ``ns.rows`` rows over ``ns.steps`` steps, the backend's fill replaced by ``fill_rows``:
    each step's whole `GrammarRows.fill` time and its llguidance part. A fresh walk per variant: llguidance
    keeps a state's mask, so a second fill at the same state would cost nothing."""
    os.environ["SLUICE_GRAMMAR_THREADS"] = str(starts)  # the independent starts the rows are forked from
    gr = GrammarRows(lambda: backend, VOCAB, ns.rows, torch.device("cpu"))
    rids = [f"r{i}" for i in range(ns.rows)]
    for rid in rids:
        gr.add(rid, spec, [])
        gr.fill([rid], np.array([0]))  # its compile done before the next one comes (as over a run's steps)
    rows, rng = np.arange(ns.rows), np.random.default_rng(0)
    whole, inner = [], []

    def timed(pairs, host):
        t0 = time.perf_counter()
        fill_rows(pairs, host)
        inner.append(time.perf_counter() - t0)

    backend.fill_bitmasks = timed
    for _ in range(ns.steps):
        t0 = time.perf_counter()
        bitmask, _ = gr.fill(rids, rows)
        whole.append(time.perf_counter() - t0)
        if ns.warm:  # the rows stay where they are: each step recomputes the same masks from warm lexer states
            continue
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :VOCAB]
        gr.accept_rows(rids, [int(rng.choice(np.flatnonzero(b))) for b in bits], rows)
        assert not gr.failures, gr.failures
    del backend.fill_bitmasks
    return whole, inner


def executor_fill(n: int):
    ex = LLExecutor(num_threads=n)

    def fill(pairs, host):
        ex.unsafe_compute_mask_ptr([(m.raw, i) for m, i in pairs], host.ctypes.data, host.shape[1] * 4, len(host))

    return fill


def serial_fill(pairs, host):
    for m, i in pairs:
        m.fill_bitmask(host, i)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 8], help="LLExecutor sizes to time")
    p.add_argument(
        "--warm",
        action="store_true",
        help="no tokens between steps: the cost of the lock and threads alone, without "
        "the lexer states a walk meets for the first time (each start builds its own)",
    )
    ns = p.parse_args()
    backend = load_backend("llguidance", str(default_tokenizer_dir()), VOCAB, [2])
    spec = StructuredOutputsParams(json=LONG_SCHEMA)
    backend.compile(spec)
    # (name, fill, independent starts the rows fork): each executor size with one start per thread (the engine's
    # rule, `core/structured/starts.py`) and with every row forked from one start (the rule before it)
    variants = [("serial", serial_fill, 1)]
    for n in ns.threads:
        variants += [(f"executor{n}", executor_fill(n), n), (f"executor{n}/1", executor_fill(n), 1)]
    n = max(ns.threads)  # and every row from a start of its own: no lock shared at all, no lexer cache either
    variants.append((f"executor{n}/{ns.rows}", executor_fill(n), ns.rows))
    print(f"{ns.rows} rows, {ns.steps} steps: ms per step, median / p90 (whole fill; llguidance's part)")
    print("(executorN: llguidance's executor on N threads, the rows forked from N starts; executorN/1: from one;")
    print(" executorN/R: each of the R rows from its own)")
    for name, fill_rows, starts in variants:
        whole, inner = walk(backend, spec, ns, fill_rows, starts)
        q = [(statistics.median(v) * 1e3, sorted(v)[int(0.9 * len(v))] * 1e3) for v in (whole, inner)]
        print(f"  {name:10s} {q[0][0]:7.3f} / {q[0][1]:7.3f}   {q[1][0]:7.3f} / {q[1][1]:7.3f}")


if __name__ == "__main__":
    main()
