"""TPRunner: what the executor actor runs instead of a `ModelRunner` when ``tensor_parallel_size > 1``.

It starts one worker process per local rank (multiprocessing "spawn": CUDA cannot be forked), sends each
step to rank 0 over a pipe (rank 0 broadcasts it to the others, `core/worker/tp/worker.py`) and waits for rank
0's `ModelOutput`. The engine's process holds no model.

A worker that dies must not leave the engine hanging: every wait also watches the local workers'
process sentinels, so a death during a step ends the step at once with a `WorkerDiedError` naming the
rank, which the scheduler turns into a dead engine (every request fails, ``/health`` answers 503). A
watcher thread notices deaths between steps too. The remaining workers are then stopped: they may be
stuck in a collective with the dead one. Ranks on other hosts have no sentinel here; their death fails
rank 0's next collective (its sockets close), or times out (`core.distributed.COLLECTIVE_TIMEOUT`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import threading
import time
import weakref
from multiprocessing.connection import wait

import torch
from sluice.core.args import EngineArgs
from sluice.core.errors import InvalidRequestError, WorkerDiedError
from sluice.core.main_guard import check_main_guard
from sluice.core.models.loader import ModelSource
from sluice.core.step import ModelOutput, SchedulerOutput
from sluice.core.worker.runner import LaunchedStep
from sluice.core.worker.tp.distributed import COLLECTIVE_TIMEOUT, rendezvous
from sluice.core.worker.tp.worker import WorkerSpec, run_worker

logger = logging.getLogger("sluice")

# Loading a large model on every rank (and ranks on other hosts joining) may take long.
START_TIMEOUT_S = COLLECTIVE_TIMEOUT.total_seconds() + 600
# After rank 0 reports a failed step: how long a peer's death (its likely cause) may take to show.
DEATH_GRACE_S = 2.0
STOP_TIMEOUT_S = 10.0


class TPRunner:
    """The `Runner` over tensor-parallel worker processes: each step whole (no step in flight behind another)."""

    graphs = None  # CUDA graphs are off at tensor_parallel_size > 1
    drafter = None  # so is speculative decoding (EngineArgs refuses it)
    num_speculative_tokens = 0
    max_uniform_batch = 0
    overlaps_steps = False
    out_of_process = True

    def __init__(self, args: EngineArgs, source: ModelSource, max_model_len: int) -> None:
        check_main_guard()
        world = args.tensor_parallel_size
        heads = source.config.num_attention_heads
        if world > heads:
            raise InvalidRequestError(
                f"tensor_parallel_size: {world} exceeds the model's {heads} attention heads",
                param="tensor_parallel_size",
            )
        local = args.tensor_parallel_local_size or world
        device = args.resolve_device()
        if device.type == "cuda" and torch.cuda.device_count() < local:
            raise InvalidRequestError(
                f"tensor_parallel_size: {local} ranks on this host need {local} GPUs, found "
                f"{torch.cuda.device_count()}",
                param="tensor_parallel_size",
            )
        addr, port = rendezvous(args)
        self.world_size = world
        self.failure: Exception | None = None
        self._closing = False
        # The watcher thread and the executor's thread both reap dead workers: one waitpid wins, the other
        # sees ECHILD and a still-unset exit code, so reaping goes through this lock.
        self._reap_lock = threading.Lock()
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.procs: list[mp.Process] = []
        for rank in range(local):
            spec = WorkerSpec(rank, world, rank, local, addr, port, device.type)
            if rank == 0:
                spec.args, spec.max_model_len = args, max_model_len
            p = ctx.Process(
                target=run_worker, args=(spec, child if rank == 0 else None), name=f"sluice-tp-{rank}", daemon=True
            )
            p.start()
            self.procs.append(p)
        child.close()  # rank 0 holds the other end: its exit shows here as EOF
        self._sentinels = [p.sentinel for p in self.procs]
        # if the engine is dropped without closing: the workers go with it
        self._finalizer = weakref.finalize(self, _stop_processes, self.procs, 0.0)
        try:
            self.num_kv_blocks = self._wait_ready()
        except BaseException:
            self.close()
            raise
        logger.info(
            "tensor parallel: %d ranks (%d on this host, %s, rendezvous %s:%d), KV pool %d blocks",
            world,
            local,
            "nccl" if device.type == "cuda" else "gloo",
            addr,
            port,
            self.num_kv_blocks,
        )
        threading.Thread(target=self._watch, name="sluice-tp-watch", daemon=True).start()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the local ranks, by rank."""
        return [p.pid for p in self.procs]

    def _wait_ready(self) -> int:
        ready = wait([self._conn, *self._sentinels], timeout=START_TIMEOUT_S)
        if self._conn in ready:
            try:
                kind, value = self._conn.recv()
            except (EOFError, OSError):
                kind, value = "died", None
            if kind == "error":
                raise value
            if kind == "ready":
                return value
        if not ready:
            raise WorkerDiedError(f"tensor-parallel workers did not start within {START_TIMEOUT_S:.0f} s")
        wait(self._sentinels, timeout=DEATH_GRACE_S)
        raise self._dead_worker(when=" during start-up") or WorkerDiedError("tensor-parallel rank 0 closed its pipe")

    def _dead_worker(self, ranks=None, when: str = "") -> WorkerDiedError | None:
        """The error for the first dead rank of ``ranks`` (default: all), preferring one killed by a signal:
        the others often exit only because a collective with it failed."""
        dead = []
        with self._reap_lock:
            for rank in ranks if ranks is not None else range(len(self.procs)):
                p = self.procs[rank]
                if p.exitcode is None and wait([p.sentinel], timeout=0):
                    p.join(1.0)  # exited but not reaped yet: its exit code comes with the reaping
                if p.exitcode is not None:
                    dead.append((p.exitcode >= 0, rank, p))
        if not dead:
            return None
        _, rank, p = min(dead, key=lambda d: d[0])
        code = p.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return WorkerDiedError(f"tensor-parallel worker rank {rank} (pid {p.pid}) died{when}: {how}")

    def _watch(self) -> None:
        wait(self._sentinels)
        if not self._closing and self.failure is None:
            self.failure = self._dead_worker() or WorkerDiedError("a tensor-parallel worker died")
            logger.error("%s", self.failure)

    def launch(self, so: SchedulerOutput) -> LaunchedStep:
        """The step computed whole (`execute`), complete at launch."""
        return LaunchedStep(so, self.execute(so))

    def collect(self, step: LaunchedStep) -> ModelOutput:
        return step.output

    def execute(self, so: SchedulerOutput) -> ModelOutput:
        """One step on every rank (called from the executor actor's worker thread)."""
        if self.failure is not None:
            return ModelOutput(so.step_id, {}, error=self.failure, fatal=True)
        out, ready = None, []
        try:
            self._conn.send(so)
            ready = wait([self._conn, *self._sentinels])
            if self._conn in ready:
                out = self._conn.recv()
        except (EOFError, OSError):
            pass
        if out is not None and not out.fatal:
            return out
        if out is not None:
            # Rank 0 failed the step (and exits). A peer's death fails rank 0's collectives: name the
            # dead peer where there is one, rather than the error rank 0 saw.
            wait(self._sentinels[1:], timeout=DEATH_GRACE_S)
            error = self._dead_worker(range(1, len(self.procs))) or out.error
        else:  # a worker died; rank 0 exits by itself when a peer's death fails its broadcast: peers first
            if not any(p.sentinel in ready for p in self.procs):
                wait(self._sentinels, timeout=DEATH_GRACE_S)
            ranks = [*range(1, len(self.procs)), 0]
            error = (
                self._dead_worker(ranks)
                or self.failure  # the watcher thread may have named the dead rank first
                or WorkerDiedError("tensor-parallel rank 0 closed its pipe")
            )
        self.failure = error
        logger.error("tensor-parallel step %d failed: %s", so.step_id, error)
        _stop_processes(self.procs, 0.0)
        return ModelOutput(so.step_id, {}, error=error, fatal=True)

    def close(self) -> None:
        """Stop every worker (a None step ends all ranks, remote ones too); kill what does not stop."""
        if self._closing:
            return
        self._closing = True
        if self.procs and self.procs[0].is_alive():
            try:
                self._conn.send(None)
            except (OSError, EOFError):
                pass
        _stop_processes(self.procs, STOP_TIMEOUT_S)
        self._conn.close()
        self._finalizer.detach()


def _stop_processes(procs: list, grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join()
