"""One tensor-parallel rank: a process that holds its shard of the model and runs every step.

Rank 0 is started by the engine (`core/worker/tp/runner.py`) with a pipe to it: it receives each step's
`SchedulerOutput`, broadcasts it to the other ranks over the control group, runs the step like every rank,
and sends the sampled tokens back. The other ranks only follow the broadcasts. A ``None`` step ends them
all. Rank 0 also broadcasts the engine's configuration at start, so ranks on other hosts need nothing but
the rendezvous variables:

    MASTER_ADDR=<engine host> MASTER_PORT=<port> WORLD_SIZE=<n> RANK=<r> LOCAL_RANK=<gpu> \\
        python -m sluice.core.worker.tp.worker

(the engine itself runs with ``--tensor-parallel-local-size`` = the ranks of its own host).

Any error in a step ends the worker: a rank that skipped its part of a step would leave the others
waiting in a collective. Rank 0 reports the error first; the engine then stops every worker.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from dataclasses import dataclass, replace

import torch
from sluice.core import cpu_threads, envs
from sluice.core.args import EngineArgs
from sluice.core.errors import InvalidRequestError

logger = logging.getLogger("sluice")


@dataclass(slots=True)
class WorkerSpec:
    rank: int
    world_size: int
    local_rank: int  # the GPU index on its host
    local_world_size: int  # ranks on its host (they share its CPU cores)
    master_addr: str
    master_port: int
    device_type: str  # "cuda" or "cpu", the same on every rank (it picks the backend)
    # rank 0 only: what it broadcasts to the others
    args: EngineArgs | None = None
    max_model_len: int | None = None


def run_worker(spec: WorkerSpec, conn=None) -> None:
    """The process's whole life: join the group, build this rank's runner, serve steps until told to stop.
    ``conn`` (rank 0 only) is its pipe to the engine."""
    from sluice.core.models.loader import resolve_model
    from sluice.core.worker.model_runner import ModelRunner
    from sluice.core.worker.tp.distributed import broadcast_from_rank0, init_tensor_parallel, shutdown_tensor_parallel

    try:
        device = torch.device(f"cuda:{spec.local_rank}" if spec.device_type == "cuda" else "cpu")
        tp = init_tensor_parallel(spec.rank, spec.world_size, spec.master_addr, spec.master_port, device)
        args, max_model_len, device_type = broadcast_from_rank0(tp, (spec.args, spec.max_model_len, spec.device_type))
        if device_type != spec.device_type:
            raise InvalidRequestError(f"device: rank 0 runs on {device_type}, rank {spec.rank} on {spec.device_type}")
        args = replace(args, device=str(device))
        if device.type == "cpu":  # before the model is built; the host's cores are shared by its ranks
            cpu_threads.apply(cpu_threads.decide(args.cpu_threads, spec.local_world_size))
        runner = ModelRunner(args, resolve_model(args.model, envs.SLUICE_CACHE_DIR), max_model_len, tp)
    except BaseException as e:
        if conn is not None:
            _send(conn, ("error", _picklable(e)))
        raise
    if conn is not None:
        _send(conn, ("ready", runner.num_kv_blocks))
        _serve(runner, tp, conn)
    else:
        while (so := broadcast_from_rank0(tp)) is not None:
            runner.execute(so)
    shutdown_tensor_parallel()


def _serve(runner, tp, conn) -> None:
    from sluice.core.step import ModelOutput
    from sluice.core.worker.tp.distributed import broadcast_from_rank0

    while True:
        try:
            so = conn.recv()
        except (EOFError, OSError):  # the engine is gone: stop the others too
            so = None
        broadcast_from_rank0(tp, so)
        if so is None:
            return
        try:
            out = runner.execute(so)
        except Exception as e:
            logger.exception("tensor-parallel rank 0: step %d failed", so.step_id)
            _send(conn, ModelOutput(so.step_id, {}, error=_picklable(e), fatal=True))
            sys.exit(1)
        if not _send(conn, out):  # the engine is gone: stop the others too
            broadcast_from_rank0(tp, None)
            return


def _send(conn, msg) -> bool:
    try:
        conn.send(msg)
    except (OSError, EOFError):
        return False
    return True


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def main() -> int:
    """A rank on another host, from the rendezvous variables torchrun also sets."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env = os.environ
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK") if k not in env]
    if missing:
        print(f"tp_worker: set {', '.join(missing)} (see the module docstring)", file=sys.stderr)
        return 2
    rank = int(env["RANK"])
    if rank == 0:
        print("tp_worker: rank 0 is the engine itself (sluice serve --tensor-parallel-size N ...)", file=sys.stderr)
        return 2
    spec = WorkerSpec(
        rank=rank,
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
        master_addr=env["MASTER_ADDR"],
        master_port=int(env["MASTER_PORT"]),
        # as the engine's --device: auto = cuda where there is a GPU
        device_type=envs.SLUICE_TP_DEVICE or ("cuda" if torch.cuda.is_available() else "cpu"),
    )
    run_worker(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
