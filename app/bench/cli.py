"""`sluice bench <name>`: each benchmark lives in its own module and adds its own subcommand here."""

from __future__ import annotations

import importlib

# benchmark modules, each with `add_parser(subparsers)` registering one subcommand
BENCHMARKS = ("app.bench.throughput", "app.bench.latency", "app.bench.serve")


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks: " + ", ".join(m.rsplit(".", 1)[1] for m in BENCHMARKS))
    sub = p.add_subparsers(dest="bench_command", required=True)
    for name in BENCHMARKS:
        importlib.import_module(name).add_parser(sub)


def main(argv: list[str] | None = None) -> int:
    """`python -m app.bench.cli throughput ...` (the same as `sluice bench throughput ...`)."""
    from app.cli import main as sluice_main

    return sluice_main(["bench", *(argv if argv is not None else __import__("sys").argv[1:])])


if __name__ == "__main__":
    raise SystemExit(main())
