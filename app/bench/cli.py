"""`sluice bench ...`: one subcommand per benchmark. Each lives in its own module with a
``register(subparsers)`` that adds its parser; add a module's name to `BENCHMARKS` to add a benchmark."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = (
    "sluice.app.bench.throughput",
    "sluice.app.bench.latency",
    "sluice.app.bench.serve",
    "sluice.app.bench.prefix",
    "sluice.app.bench.perplexity",
    "sluice.app.bench.host",
    "sluice.app.bench.steps",
    "sluice.app.bench.clients",
    "sluice.app.bench.disagg",
    "sluice.app.bench.structured",
    "sluice.app.bench.cpu_load",
    "sluice.app.bench.cpu_peer",
)


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: " + ", ".join(m.rsplit(".", 1)[1] for m in BENCHMARKS))
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for name in BENCHMARKS:
        importlib.import_module(name).register(sub)


def main(argv: list[str] | None = None) -> int:
    """`python -m sluice.app.bench.cli throughput ...` (the same as `sluice bench throughput ...`)."""
    from sluice.app.commands.cli import main as sluice_main

    return sluice_main(["bench", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    raise SystemExit(main())
