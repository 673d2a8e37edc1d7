"""`sluice bench steps`: the engine's host time per step against the device's, at several batch sizes.

One engine runs, for each ``--batch-sizes`` entry N, N requests admitted at once (``--input-len`` random
prompt tokens, ``--output-len`` forced output tokens, greedy, final outputs only), so most of its steps
decode N sequences. For each batch the engine's host profile (`AsyncEngine.host_profile`) over those steps
says where the host time went by phase, and, on a GPU, the device's time per step (CUDA events around each
step's work): ``host_over_gpu`` <= 1 means the device, not the host, bounds the step.
"""

from __future__ import annotations

import argparse
import time

from sluice.app.bench.common import drive_engine, print_figures, release_device_memory
from sluice.app.bench.datasets import sample_random
from sluice.app.bench.results import command_line, machine_line, write_result


def register(sub) -> None:
    from sluice.app.commands.cli import add_engine_args

    p = sub.add_parser("steps", help="host time per step against the device's, at several batch sizes")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256, 512], help="decode batch sizes to measure")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=256, help="output tokens per request")
    p.add_argument("--out", default=None, help="write the JSON result here")
    add_engine_args(p)
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    from dataclasses import replace

    import anyio
    from sluice.app.commands.cli import engine_args_from
    from sluice.core import AsyncEngine

    args = engine_args_from(ns)
    top = max(ns.batch_sizes)
    args = replace(
        args, max_num_seqs=max(args.max_num_seqs, top), max_waiting_requests=max(args.max_waiting_requests, top)
    )
    figures: dict = {"batches": {}}

    async def go() -> None:
        async with AsyncEngine(args) as engine:
            vocab = engine.source.config.vocab_size
            await drive_engine(engine, sample_random(8, ns.input_len, 16, vocab, seed=1), tag="warmup")
            for n in ns.batch_sizes:
                requests = sample_random(n, ns.input_len, ns.output_len, vocab, seed=n)
                before, steps0 = engine.host_profile(), engine.stats().num_steps
                cpu0 = time.process_time()
                run = await drive_engine(engine, requests, tag=f"b{n}", final_only=True)
                cpu = time.process_time() - cpu0
                steps = engine.stats().num_steps - steps0
                prof = engine.host_profile().since(before).per_step_ms()
                row = {
                    "num_steps": steps,
                    "elapsed_s": run.elapsed_s,
                    "wall_ms_per_step": 1e3 * run.elapsed_s / max(steps, 1),
                    "process_cpu_ms_per_step": 1e3 * cpu / max(steps, 1),
                    "output_tokens_per_s": sum(run.output_lens) / max(run.elapsed_s, 1e-9),
                    "host_profile_ms_per_step": prof,
                }
                figures["batches"][str(n)] = row
                print_figures(f"batch {n}", row)

    anyio.run(go)
    release_device_memory()
    print(machine_line())
    if ns.out:
        cfg = {"name": "random", "batch_sizes": ns.batch_sizes, "input_len": ns.input_len, "output_len": ns.output_len}
        write_result(ns.out, command_line(), ns.model, cfg, figures)
        print(f"wrote {ns.out}")
    return 0
