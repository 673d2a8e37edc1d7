"""How many threads tokenize large prompts: the cores this process may use, less those the engine keeps busy.

A large prompt is tokenized off the event loop (a tokenizer releases the GIL while it works), so each such thread
takes a core. With one thread, a flood of big prompts queued every other big prompt behind it (a 17 KB prompt
waited seconds for its 20 ms); with one thread per core, tokenizing would take the cores the engine's own
threads need every step. So the pool gets the cores left over, and at least one.
"""

from __future__ import annotations

import os

from sluice.core.args import EngineArgs


def engine_busy_threads(args: EngineArgs) -> int:
    """Threads of the engine that run all the time, on this host: the front end's event loop; the core's
    event loop (in the front end's when the core shares its process) and its launch thread; one process per
    further local tensor-parallel rank."""
    own_core_process = args.engine_core_process and not args.enable_inspector  # `AsyncEngine._split`
    local_ranks = args.tensor_parallel_local_size or args.tensor_parallel_size
    return 1 + (2 if own_core_process else 1) + (local_ranks - 1)


def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask; every core where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def tokenizer_threads(args: EngineArgs, cpus: int | None = None) -> int:
    """Threads for tokenizing large prompts: the usable cores less the engine's busy threads, at least 1."""
    cpus = usable_cpus() if cpus is None else cpus
    return max(1, cpus - engine_busy_threads(args))
