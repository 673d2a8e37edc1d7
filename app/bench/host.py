"""`sluice bench host`: the engine's host time per step, with the model's forward replaced by a stub.

The stub (installed from outside, on the model class: `stub_source`) sleeps a constant time per forward, as
a GPU would take it while releasing the host, and returns zero hidden states and narrow zero logits, so
every request decodes token 0 cheaply. Everything else runs as in serving: the actors, the scheduler, the
KV manager, step-input preparation, sampling, output processing and delivery. So the host path can be
measured and tuned on a machine without a GPU.

Figures per run (after a warm-up), over ``--num-seqs`` requests admitted at once, each of ``--input-len``
random prompt tokens and ``--output-len`` forced output tokens:

* ``cpu_ms_per_step``: CPU seconds of the whole process (every thread) per engine step: the host work,
  since the stub's sleep costs none;
* ``wall_ms_per_step``: wall time per step (at least the stub's time; more when host work is not overlapped);
* ``first_forward_ms``: from submitting the burst to its first forward: the admission of ``--num-seqs`` requests
  at once, which on a GPU is the device's idle time before a throughput run's first step;
* where the engine reports it, the step's host time by phase (`AsyncEngine.host_profile`).

Both builds run with one intra-op thread for torch (``--intra-op-threads``, ``OMP_NUM_THREADS``): with the
forward stubbed there is nothing to parallelize, and an OpenMP pool's idle workers spin-wait after every small
op, which the process CPU clock counts as several times the host work being measured.

``--baseline REF`` runs the same measurement on another commit of this repository (checked out into a
temporary worktree, imported from there), alternating with this tree in one run, and prints the ratios.
The stub only relies on what every build has: the public API and the model's ``forward`` /
``compute_logits``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from sluice.app.bench.common import print_figures
from sluice.app.bench.results import command_line, machine_line, write_result
from sluice.core.errors import SluiceError

REPO = Path(__file__).resolve().parents[2]

# The measurement, run in a child process over the tree its PYTHONPATH names: only the public API and the
# model class's forward / compute_logits, so that it runs on older builds too.
CHILD = r"""
import json, sys, time
import anyio, torch
from sluice.core import AsyncEngine, EngineArgs, SamplingParams
import sluice.core.models.llama as llama

cfg = json.loads(sys.argv[1])
STUB_S, WIDTH = cfg["stub_ms"] / 1000.0, cfg["logits_width"]
FIRST = []  # when the first forward since the list was cleared began


def forward(self, input_ids, positions, ctx, aux_layers=()):
    if not FIRST:
        FIRST.append(time.perf_counter())
    time.sleep(STUB_S)  # the GPU's time: the host is free meanwhile
    hidden = torch.zeros(input_ids.shape[0], self.config.hidden_size, dtype=self.model.embed_tokens.weight.dtype)
    return (hidden, hidden) if aux_layers else hidden


def compute_logits(self, hidden):
    logits = torch.zeros(hidden.shape[0], WIDTH, dtype=torch.float32)
    logits[:, -1] = 1.0  # every row decodes token WIDTH - 1, an ordinary one (a text piece, not EOS)
    return logits


llama.LlamaForCausalLM.forward = forward
llama.LlamaForCausalLM.compute_logits = compute_logits


def prompts(n, input_len):
    return [[1 + (i * 7919 + j * 104729) % 1000 for j in range(input_len)] for i in range(n)]


async def batch(engine, prompts, output_len, tag):
    final_only = not cfg["stream"]

    async def one(i):
        prompt = prompts[i]
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        got = 0
        async for out in engine.generate(prompt, params, request_id=f"{tag}-{i}", final_only=final_only):
            got = len(out.token_ids)
        assert got == output_len, (got, output_len)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)


async def main():
    n, il, ol = cfg["num_seqs"], cfg["input_len"], cfg["output_len"]
    blocks = n * (-(-(il + ol) // 16) + 1) + 64
    args = EngineArgs(
        model=cfg["model"], device="cpu", max_num_seqs=n, max_num_batched_tokens=max(cfg["max_batched"], n),
        max_waiting_requests=2 * n, num_kv_blocks=blocks, max_model_len=il + ol + 16,
        enable_prefix_caching=False, **cfg["engine"],
    )
    async with AsyncEngine(args) as engine:
        await batch(engine, prompts(min(n, 8), il), 8, "warmup")
        burst = prompts(n, il)  # built before the clock starts, as a requests file's are
        profile = getattr(engine, "host_profile", None)
        before_prof = profile() if profile else None
        steps0 = engine.stats().num_steps
        FIRST.clear()
        cpu0, t0 = time.process_time(), time.perf_counter()
        await batch(engine, burst, ol, "run")
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        steps = engine.stats().num_steps - steps0
        res = {"steps": steps, "wall_s": wall, "cpu_s": cpu,
               "cpu_ms_per_step": 1e3 * cpu / steps, "wall_ms_per_step": 1e3 * wall / steps,
               "first_forward_ms": 1e3 * (FIRST[0] - t0)}
        if profile:
            res["phases_ms_per_step"] = profile().since(before_prof).per_step_ms()
    print("RESULT " + json.dumps(res))


anyio.run(main)
"""


def register(sub) -> None:
    p = sub.add_parser("host", help="host time per engine step, the model's forward stubbed (runs on the CPU)")
    p.add_argument("--model", default="dummy:tiny", help="a model shape (its weights are never used)")
    p.add_argument("--num-seqs", type=int, default=512, help="requests admitted at once (and max_num_seqs)")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=256, help="output tokens per request")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the scheduler's token budget per step")
    p.add_argument("--stub-ms", type=float, default=2.0, help="the stubbed forward's time per step")
    p.add_argument("--logits-width", type=int, default=64, help="columns of the stub's logits")
    p.add_argument("--stream", action="store_true", help="stream every token (default: final outputs only)")
    p.add_argument("--rounds", type=int, default=3, help="runs per build (alternating with --baseline)")
    p.add_argument("--baseline", default=None, help="also measure this git commit of the repository, in turns")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="an EngineArgs field for this tree's runs (repeatable), e.g. async_scheduling=false",
    )
    p.add_argument(
        "--intra-op-threads",
        type=int,
        default=1,
        help="torch's intra-op threads in both builds' runs (OMP_NUM_THREADS); see the module doc",
    )
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.set_defaults(func=main)


def namespace_dir(tree: Path, into: Path) -> Path:
    """A folder whose ``sluice/`` links to ``tree``'s parts: on PYTHONPATH it imports that tree."""
    pkg = into / "sluice"
    pkg.mkdir(parents=True, exist_ok=True)
    for part in ("app", "core", "kv", "spec"):
        link = pkg / part
        if link.is_symlink():
            link.unlink()
        link.symlink_to(tree / part)
    return into


def add_baseline_tree(ref: str, into: Path) -> None:
    """Check ``ref`` of this repository out at ``into`` (a detached git worktree). Only a git checkout has other
    commits: an installed copy, a missing git or an unknown ref is one line (a `SluiceError`), not git's
    traceback."""
    try:
        top = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    except FileNotFoundError:
        raise SluiceError("--baseline needs git, which is not installed") from None
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != REPO:
        raise SluiceError(
            f"--baseline needs a git checkout of sluice, and this one is installed at {REPO}: clone the "
            "repository and run `sluice bench host` from the clone (PYTHONPATH=$(scripts/namespace_path.sh))"
        )
    add = ["git", "-C", str(REPO), "worktree", "add", "--detach", str(into), ref]
    run = subprocess.run(add, capture_output=True, text=True)
    if run.returncode != 0:
        why = (run.stderr.strip().splitlines() or ["git worktree add failed"])[-1]
        raise SluiceError(f"--baseline {ref}: {why}")


def run_child(path_dir: Path, cfg: dict, intra_op_threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(path_dir), OMP_NUM_THREADS=str(intra_op_threads))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cfg)], env=env, capture_output=True, text=True, timeout=3600
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"host benchmark child failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}")


def parse_engine_args(items: list[str]) -> dict:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--engine-arg: expected NAME=JSON, got {item!r}")
        out[name] = json.loads(value)
    return out


def main(ns: argparse.Namespace) -> int:
    cfg = {
        "model": ns.model,
        "num_seqs": ns.num_seqs,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "max_batched": ns.max_num_batched_tokens,
        "stub_ms": ns.stub_ms,
        "logits_width": ns.logits_width,
        "stream": ns.stream,
        "intra_op_threads": ns.intra_op_threads,
    }
    this_cfg = {**cfg, "engine": parse_engine_args(ns.engine_arg)}
    with tempfile.TemporaryDirectory(prefix="sluice-host-") as tmp:
        trees = {"this": (namespace_dir(REPO, Path(tmp) / "this"), this_cfg)}
        if ns.baseline:
            base = Path(tmp) / "baseline-tree"
            add_baseline_tree(ns.baseline, base)
            trees["baseline"] = (namespace_dir(base, Path(tmp) / "baseline"), {**cfg, "engine": {}})
        try:
            runs: dict[str, list[dict]] = {k: [] for k in trees}
            for r in range(ns.rounds):
                order = list(trees) if r % 2 == 0 else list(reversed(trees))
                for name in order:
                    path_dir, c = trees[name]
                    res = run_child(path_dir, c, ns.intra_op_threads)
                    runs[name].append(res)
                    print(
                        f"  round {r + 1} {name}: {res['cpu_ms_per_step']:.3f} CPU ms/step, "
                        f"{res['wall_ms_per_step']:.3f} wall ms/step ({res['steps']} steps), first forward after "
                        f"{res['first_forward_ms']:.1f} ms",
                        flush=True,
                    )
        finally:
            if ns.baseline:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
    figures: dict = {"config": this_cfg, "baseline": ns.baseline}
    for name, rs in runs.items():
        figures[name] = {
            "cpu_ms_per_step": statistics.median(r["cpu_ms_per_step"] for r in rs),
            "wall_ms_per_step": statistics.median(r["wall_ms_per_step"] for r in rs),
            "first_forward_ms": statistics.median(r["first_forward_ms"] for r in rs),
            "steps": rs[0]["steps"],
            "runs": rs,
        }
        if "phases_ms_per_step" in rs[-1]:
            figures[name]["phases_ms_per_step"] = rs[-1]["phases_ms_per_step"]
        print_figures(f"{name} (medians of {len(rs)})", {k: v for k, v in figures[name].items() if k != "runs"})
        for phase, ms in figures[name].get("phases_ms_per_step", {}).items():
            print(f"    {phase:<10} {ms:8.3f} ms/step")
    if ns.baseline:
        figures["cpu_ratio_baseline_over_this"] = (
            figures["baseline"]["cpu_ms_per_step"] / figures["this"]["cpu_ms_per_step"]
        )
        figures["wall_ratio_baseline_over_this"] = (
            figures["baseline"]["wall_ms_per_step"] / figures["this"]["wall_ms_per_step"]
        )
        print(
            f"host CPU per step: baseline / this = {figures['cpu_ratio_baseline_over_this']:.2f}x; "
            f"wall per step: {figures['wall_ratio_baseline_over_this']:.2f}x"
        )
    print(machine_line())
    if ns.out:
        write_result(ns.out, command_line(), ns.model, {"name": "synthetic", **cfg}, figures)
        print(f"wrote {ns.out}")
    return 0
