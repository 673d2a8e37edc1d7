"""A competing load: keep N cores busy until killed (or for ``--seconds``), as another program on the machine would.

    PYTHONPATH=$(scripts/namespace_path.sh) python scripts/cpu_busy.py [--cores 1] [--seconds S]

Each core gets a process of its own spinning a pure-Python loop (no numpy, no threads, nothing the engine's
libraries share): the load `sluice bench cpu-load` starts beside the engine (`start_busy` there). Run by hand, it
puts any command under the same load. SIGTERM or SIGINT stops every spinner.
"""

from __future__ import annotations

import argparse
import signal
import sys

from sluice.app.bench.cpu_load import start_busy, stop_busy


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cores", type=int, default=1, help="busy processes, one core each (default 1)")
    p.add_argument("--seconds", type=float, default=None, help="stop after this long (default: until killed)")
    ns = p.parse_args(argv)
    if ns.cores < 1:
        p.error("--cores must be >= 1")
    procs = start_busy(ns.cores, ns.seconds)

    def stop(signum, frame) -> None:
        stop_busy(procs)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"cpu_busy: {ns.cores} busy process(es) {[proc.pid for proc in procs]}", flush=True)
    for proc in procs:
        proc.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
