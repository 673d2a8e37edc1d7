"""`sluice bench cpu-load`: the engine on the CPU, quiet and beside a competing load, with its default threads
and with ``OMP_NUM_THREADS=1``; the ratios issue 41 asks for.

Each run is a child process (a fresh OpenMP runtime reads its environment once, when torch loads it) holding an
in-process engine on the CPU. After a short warm-up it times:

* the small burst: ``--num-prompts`` prompts (4) of ``--input-len`` random tokens, each forced to
  ``--output-len`` tokens (16), end to end, and the CPU seconds the process burnt meanwhile;
* batch-1 decode: one ``--decode-input-len`` (128) token prompt, ``--decode-output-len`` (256) tokens, in tokens
  per second from its first token to its last.

The load is ``--load-cores`` processes (1) each spinning a pure-Python loop on one core (`start_busy`; also
``scripts/cpu_busy.py``), started before the child and stopped after it. The configurations: ``defaults`` (the
engine's own rule, `core/cpu_threads.py`), ``omp1`` (``OMP_NUM_THREADS=1``), and on request ``spin``
(``GOMP_SPINCOUNT=300000``: libgomp's spin before it sleeps when no wait policy is set, i.e. the engine before
it chose passive waits), and ``passive`` (``GOMP_SPINCOUNT=0``: no spin at all). Every repeat runs each
configuration quiet then loaded, alternating, so a slow stretch of a shared machine touches them all. The ratios
(medians): decode loaded / quiet per configuration (target >= 0.5), and the burst's loaded time with the
defaults / with ``omp1`` (target <= 2).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

from sluice.app.bench.common import print_figures
from sluice.app.bench.results import command_line, machine_line, write_result
from sluice.core.models.default_model import DEFAULT_MODEL

CONFIGS = {
    "defaults": {},
    "omp1": {"OMP_NUM_THREADS": "1"},
    "spin": {"GOMP_SPINCOUNT": "300000"},
    "passive": {"GOMP_SPINCOUNT": "0"},
}
# Variables a configuration sets; the others' values are cleared from the child's environment.
CONFIG_VARS = ("OMP_NUM_THREADS", "GOMP_SPINCOUNT")


def register(sub) -> None:
    p = sub.add_parser("cpu-load", help="the CPU engine quiet and under a competing load; default threads vs 1")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the model (default: %(default)s)")
    p.add_argument("--dtype", default="auto", help="the model dtype on the CPU (default: auto = float32)")
    p.add_argument("--load-cores", type=int, default=1, help="cores the competing load keeps busy (default 1)")
    p.add_argument("--configs", default="defaults,omp1", help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--repeats", type=int, default=2, help="alternations of every configuration, quiet and loaded")
    p.add_argument("--num-prompts", type=int, default=4, help="the burst's prompts (default 4)")
    p.add_argument("--input-len", type=int, default=32, help="the burst's prompt tokens (default 32)")
    p.add_argument("--output-len", type=int, default=16, help="the burst's output tokens (default 16)")
    p.add_argument("--decode-input-len", type=int, default=128, help="batch-1 decode: prompt tokens (default 128)")
    p.add_argument("--decode-output-len", type=int, default=256, help="batch-1 decode: output tokens (default 256)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.set_defaults(func=main)


# -- the competing load ----------------------------------------------------------------------------------------
def spin(deadline: float) -> None:
    """Burn one core: a tight pure-Python loop, the clock checked now and then."""
    x = 0
    while time.monotonic() < deadline:
        for _ in range(100_000):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def start_busy(cores: int, seconds: float | None = None) -> list:
    """``cores`` processes, each keeping one core busy (until `stop_busy`, or for ``seconds``)."""
    deadline = time.monotonic() + seconds if seconds is not None else float("inf")
    procs = [mp.get_context("spawn").Process(target=spin, args=(deadline,), daemon=True) for _ in range(cores)]
    for proc in procs:
        proc.start()
    return procs


def stop_busy(procs: list) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.join()


def run_beside_load(argv: list[str], env: dict[str, str], load_cores: int, what: str) -> dict:
    """``python -m argv...`` in a child process beside ``load_cores`` busy cores (none: quiet); the JSON object of
    its last output line. ``what`` names the run in the error when it fails."""
    busy = start_busy(load_cores) if load_cores else []
    try:
        out = subprocess.run([sys.executable, "-m", *argv], env=env, capture_output=True, text=True)
    finally:
        stop_busy(busy)
    if out.returncode != 0:
        raise RuntimeError(f"the {what} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- one run, in a child process --------------------------------------------------------------------------------
def run_child(cfg: dict) -> dict:
    """The burst and batch-1 decode on a fresh in-process engine; the figures as a dict."""
    import resource

    import anyio
    from sluice.app.bench.common import drive_engine
    from sluice.app.bench.datasets import sample_random
    from sluice.core import AsyncEngine, EngineArgs, cpu_threads
    from sluice.core.models.loader import resolve_model

    vocab = resolve_model(cfg["model"]).config.vocab_size
    longest = max(cfg["input_len"] + cfg["output_len"], cfg["decode_input_len"] + cfg["decode_output_len"])
    blocks = max(cfg["num_prompts"] * (cfg["input_len"] + cfg["output_len"]), longest) // 16 + 8
    args = EngineArgs(
        model=cfg["model"],
        device="cpu",
        dtype=cfg["dtype"],
        max_model_len=longest + 1,
        num_kv_blocks=blocks,
        enable_prefix_caching=False,
    )

    def cpu_s() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    async def go() -> dict:
        async with AsyncEngine(args) as engine:
            await drive_engine(engine, sample_random(2, 8, 4, vocab, seed=99), tag="warmup")
            c0 = cpu_s()
            burst = await drive_engine(
                engine, sample_random(cfg["num_prompts"], cfg["input_len"], cfg["output_len"], vocab, 1), tag="b"
            )
            c1 = cpu_s()
            one = await drive_engine(
                engine, sample_random(1, cfg["decode_input_len"], cfg["decode_output_len"], vocab, 2), tag="d"
            )
        decode_s = one.finish_s[0] - one.first_token_s[0]
        return {
            "burst_s": burst.elapsed_s,
            "burst_cpu_s": c1 - c0,
            "decode_tok_s": (one.output_lens[0] - 1) / decode_s if decode_s > 0 else float("nan"),
            "threads": cpu_threads.decide(args.cpu_threads).describe(),
        }

    return anyio.run(go)


def _child_env(config: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CONFIG_VARS}
    return env | CONFIGS[config]


def _run_one(ns: argparse.Namespace, config: str, loaded: bool) -> dict:
    cfg = {k: getattr(ns, k) for k in ("model", "dtype", "num_prompts", "input_len", "output_len")}
    cfg |= {"decode_input_len": ns.decode_input_len, "decode_output_len": ns.decode_output_len}
    argv = ["sluice.app.bench.cpu_load", json.dumps(cfg)]
    what = f"{config} run ({'loaded' if loaded else 'quiet'})"
    return run_beside_load(argv, _child_env(config), ns.load_cores if loaded else 0, what)


def summarize(runs: dict[tuple[str, bool], list[dict]]) -> dict:
    """Medians per configuration and load, and the issue's ratios."""
    fig: dict = {}
    for (config, loaded), rs in runs.items():
        tag = f"{config}_{'loaded' if loaded else 'quiet'}"
        fig[f"{tag}_burst_s"] = statistics.median(r["burst_s"] for r in rs)
        fig[f"{tag}_burst_cpu_s"] = statistics.median(r["burst_cpu_s"] for r in rs)
        fig[f"{tag}_decode_tok_s"] = statistics.median(r["decode_tok_s"] for r in rs)
        fig[f"{tag}_threads"] = rs[0]["threads"]
    for config in {c for c, _ in runs}:
        fig[f"{config}_decode_loaded_over_quiet"] = (
            fig[f"{config}_loaded_decode_tok_s"] / fig[f"{config}_quiet_decode_tok_s"]
        )
    if "defaults_loaded_burst_s" in fig and "omp1_loaded_burst_s" in fig:
        fig["burst_loaded_defaults_over_omp1"] = fig["defaults_loaded_burst_s"] / fig["omp1_loaded_burst_s"]
    return fig


def main(ns: argparse.Namespace) -> int:
    configs = [c.strip() for c in ns.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise ValueError(f"configs: choose from {', '.join(CONFIGS)}, got {ns.configs!r}")
    if min(ns.repeats, ns.load_cores, ns.num_prompts, ns.output_len, ns.decode_output_len) < 1:
        raise ValueError("repeats, load_cores, num_prompts, output_len and decode_output_len must be >= 1")
    print(
        f"cpu-load: {ns.num_prompts} x {ns.input_len} in / {ns.output_len} out, batch-1 decode {ns.decode_input_len} "
        f"in / {ns.decode_output_len} out; load {ns.load_cores} busy core(s); {ns.repeats} alternation(s); "
        f"os load average {os.getloadavg()[0]:.2f}"
    )
    runs: dict[tuple[str, bool], list[dict]] = {}
    for i in range(ns.repeats):
        for config in configs:
            for loaded in (False, True):
                r = _run_one(ns, config, loaded)
                runs.setdefault((config, loaded), []).append(r)
                print(
                    f"  [{i}] {config:8s} {'loaded' if loaded else 'quiet ':6s}  burst {r['burst_s']:7.2f} s "
                    f"(cpu {r['burst_cpu_s']:6.2f} s)  decode {r['decode_tok_s']:6.2f} tok/s  ({r['threads']})",
                    flush=True,
                )
    figures = summarize(runs)
    figures["load_average_after"] = os.getloadavg()[0]
    print_figures("cpu-load (medians; targets: decode loaded/quiet >= 0.5, burst defaults/omp1 loaded <= 2)", figures)
    print(machine_line())
    if ns.out:
        dataset = {"name": "random", "num_prompts": ns.num_prompts, "input_len": ns.input_len}
        dataset |= {"output_len": ns.output_len, "decode_input_len": ns.decode_input_len}
        dataset |= {"decode_output_len": ns.decode_output_len, "load_cores": ns.load_cores}
        write_result(ns.out, command_line(), ns.model, dataset, figures)
        print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":  # one run (`_run_one`): its figures as the last line of stdout
    print(json.dumps(run_child(json.loads(sys.argv[1]))))
