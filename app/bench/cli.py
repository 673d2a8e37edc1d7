"""`sluice bench ...`: one subcommand per benchmark. Each lives in its own module with a
``register(subparsers)`` that adds its parser; add a module's name to `BENCHMARKS` to add a benchmark."""

from __future__ import annotations

import importlib

BENCHMARKS = ("app.bench.prefix",)


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: " + ", ".join(m.rsplit(".", 1)[1] for m in BENCHMARKS))
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for name in BENCHMARKS:
        importlib.import_module(name).register(sub)
