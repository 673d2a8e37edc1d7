"""How many intra-op threads torch runs on the CPU, decided in one place for every process of the engine.

The count (`decide`):

1. ``--cpu-threads N`` (`EngineArgs.cpu_threads`), when given;
2. else ``OMP_NUM_THREADS``, when set (its first entry, as OpenMP reads a nested list);
3. else the cores this process may use, `usable_cores`: its affinity mask (``os.sched_getaffinity``), capped by
   its cgroup's CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``, rounded down, at least
   one); shared equally by the ranks of one host (tensor parallelism, the tests' xdist workers); minus the cores
   kept for the engine's own threads (`reserved_cores`).

Kept for the engine: the event loop(s) (front end, scheduler), the tokenizer pool and the grammar's mask threads
run beside the step. They are busy in bursts, not for a whole step, so a core is kept for them only where the
machine has four or more to share: on one or two cores, keeping one would idle half the machine for most of
every step, and with passive OpenMP waits (below) their bursts only delay a pool thread for a moment.

Where the count is applied (`apply`): the process that holds the model on the CPU (the engine core, in the
caller's process or its own: `ExecutorActor.start`), each tensor-parallel rank (`core/worker/tp/worker.py`) and
the tests' workers (`tests/conftest.py`); a front end whose core runs elsewhere does no intra-op work and takes
one thread (`sluice serve`). ``torch.set_num_threads`` sets the count of the calling thread and of threads that
run torch's first parallel op after it, not of threads that already ran one (OpenMP's count is a per-thread
setting): so it is applied where the model is built, before any step thread runs.

Why OpenMP must wait passively: torch's CPU wheel runs its intra-op pool on GNU OpenMP (libgomp, shipped in
``torch/lib``; MKL and oneDNN use the same pool). By default libgomp's workers spin after each parallel region
(300,000 times) before they sleep; with another busy process on the machine the spinning workers and the
engine's own threads take each other's time slices, and each parallel region waits for a descheduled worker:
steps many times slower, and many times the CPU burnt (`sluice bench cpu-load --configs defaults,spin` shows
both). libgomp reads the policy once, when it is loaded (with torch), so `prefer_passive_waits` sets it
(passive, with a short spin: ``SPIN_COUNT``) in the environment before torch is imported: `sluice.core`'s
``__init__`` calls it, and spawned processes (the core process, tensor-parallel ranks) inherit it. A caller's
own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is left as it is.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from sluice.core import envs

logger = logging.getLogger("sluice")

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")  # this process's cgroup path, per hierarchy

# From this many cores per rank on, one is kept for the engine's own threads (see the module doc).
RESERVE_FROM_CORES = 4


@dataclass(frozen=True, slots=True)
class CpuThreads:
    """The decided count and where it came from (for the start-up log line and the benchmarks' JSON)."""

    count: int
    source: str  # "--cpu-threads", "OMP_NUM_THREADS" or "cores"
    usable_cores: int
    reserved_cores: int

    def describe(self) -> str:
        if self.source != "cores":
            return f"{self.count} intra-op thread(s) ({self.source})"
        return (
            f"{self.count} intra-op thread(s) ({self.usable_cores} usable core(s), {self.reserved_cores} kept for "
            "the engine's own threads)"
        )


def affinity_cores() -> int:
    """CPUs this process may run on (its affinity mask); every CPU where the platform has no affinity call."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _cgroup_dirs(root: Path) -> list[Path]:
    """This process's cgroup folders under ``root`` and their parents (v2 unified, v1 cpu controller), deepest
    first; a limit anywhere on the path applies."""
    dirs = []
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
        elif "cpu" in controllers.split(","):
            base = root / controllers if (root / controllers).is_dir() else root / "cpu"
        else:
            continue
        here = base / path.lstrip("/")
        dirs += [here, *(p for p in here.parents if p.is_relative_to(base))]
    return dirs or [root, root / "cpu"]


def cgroup_quota_cores(root: Path | None = None) -> float | None:
    """The smallest CPU quota on this process's cgroup path, in cores (1.5 = 150 ms per 100 ms); None when
    there is none."""
    quotas = []
    for d in _cgroup_dirs(root or CGROUP_ROOT):
        try:
            if (d / "cpu.max").is_file():
                quota, period = (d / "cpu.max").read_text().split()[:2]
            elif (d / "cpu.cfs_quota_us").is_file():
                quota = (d / "cpu.cfs_quota_us").read_text().strip()
                period = (d / "cpu.cfs_period_us").read_text().strip()
            else:
                continue
        except (OSError, ValueError):
            continue
        if quota not in ("max", "-1") and int(period) > 0:
            quotas.append(int(quota) / int(period))
    return min(quotas) if quotas else None


def usable_cores(root: Path | None = None) -> int:
    """Cores this process may keep busy: its affinity, capped by its cgroup quota (rounded down, at least 1)."""
    cores = affinity_cores()
    quota = cgroup_quota_cores(root)
    if quota is not None:
        cores = min(cores, max(1, int(quota)))
    return max(1, cores)


def reserved_cores(share: int) -> int:
    """Cores of a rank's ``share`` kept for the engine's own threads (see the module doc)."""
    return 1 if share >= RESERVE_FROM_CORES else 0


def decide(requested: int | None = None, ranks: int = 1) -> CpuThreads:
    """The intra-op thread count of one of ``ranks`` model-holding processes on this host (see the module doc)."""
    if requested is not None:
        return CpuThreads(requested, "--cpu-threads", usable_cores(), 0)
    from_env = envs.omp_num_threads()
    if from_env is not None:
        return CpuThreads(from_env, "OMP_NUM_THREADS", usable_cores(), 0)
    cores = usable_cores()
    share = max(1, cores // max(1, ranks))
    reserved = reserved_cores(share)
    return CpuThreads(max(1, share - reserved), "cores", cores, reserved)


def front_end() -> CpuThreads:
    """A front end whose engine core runs in another process: no intra-op work of its own (it tokenizes,
    schedules nothing, streams), so one thread, and no OpenMP pool beside the core's."""
    return CpuThreads(1, "a front end, its core in another process", usable_cores(), 0)


def apply(threads: CpuThreads) -> None:
    """Set torch's intra-op thread count in this process (see the module doc for which threads it reaches)."""
    import torch

    if torch.get_num_threads() != threads.count:
        torch.set_num_threads(threads.count)
    logger.info("cpu: %s", threads.describe())
    if _policy["too_late"] and threads.count > 1:
        _policy["too_late"] = False  # said once
        logger.warning(
            "cpu: torch was imported before sluice.core, so its OpenMP workers spin when idle and slow the engine "
            "down under other load; import sluice.core first, or export OMP_WAIT_POLICY=PASSIVE"
        )


# libgomp's spins before an idle worker sleeps: long enough to bridge the gap between two ops of one step (a
# worker that slept must be woken by a futex, which at batch 1 costs more than the op), short enough that
# workers are asleep between steps and do not hold a core another process needs (`sluice bench cpu-load`,
# `cpu-peer`: passive alone, 0 spins, made 2-thread decode slower than 1 thread on a quiet machine).
SPIN_COUNT = 20_000

_policy = {"too_late": False}  # set here after torch (and OpenMP) had loaded: this process's workers still spin


def prefer_passive_waits() -> None:
    """OpenMP workers that sleep when idle instead of spinning: set before torch loads its OpenMP runtime (see
    the module doc); a no-op where the caller chose a policy."""
    if envs.set_default_openmp_waits("PASSIVE", SPIN_COUNT) and "torch" in sys.modules:
        _policy["too_late"] = True
