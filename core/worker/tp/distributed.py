"""torch.distributed for tensor parallelism: the rendezvous and the two process groups of one rank.

Ranks meet through torch.distributed's standard TCP rendezvous at ``MASTER_ADDR:MASTER_PORT`` (the
variables torchrun sets); rank 0, in the engine's host, serves it. Without them every rank is on this
host and the engine picks a free loopback port.

Each rank has two groups over the same ranks:

* the default group carries activations (all-reduce, all-gather): NCCL on GPUs, gloo on the CPU, with
  `COLLECTIVE_TIMEOUT`, after which a rank stuck in a collective (a peer died mid-step) fails;
* a gloo group carries the control traffic: each step's `SchedulerOutput` from rank 0 and the agreed
  KV pool size. Between steps the other ranks wait on it for as long as the engine idles, so its
  timeout is practically unbounded; a peer that dies closes its sockets, which fails the wait at once.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
from sluice.core.args import EngineArgs
from sluice.core.errors import InvalidRequestError
from sluice.core.models.parallel import TensorParallel

COLLECTIVE_TIMEOUT = timedelta(minutes=10)
CONTROL_TIMEOUT = timedelta(days=3650)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous(args: EngineArgs) -> tuple[str, int]:
    """``(MASTER_ADDR, MASTER_PORT)`` for the engine's ranks. Ranks on other hosts need both set."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    local = args.tensor_parallel_local_size or args.tensor_parallel_size
    if local < args.tensor_parallel_size and not (addr and port):
        raise InvalidRequestError(
            f"tensor_parallel_local_size: ranks {local}..{args.tensor_parallel_size - 1} run on other hosts, "
            "which need MASTER_ADDR and MASTER_PORT (this host's address and a free port) set on every host",
            param="tensor_parallel_local_size",
        )
    try:
        return addr or "127.0.0.1", int(port) if port else free_port()
    except ValueError:
        raise InvalidRequestError(f"MASTER_PORT must be a port number, got {port!r}") from None


def init_tensor_parallel(
    rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device
) -> TensorParallel:
    """Join the group (blocks until every rank has joined, at most `COLLECTIVE_TIMEOUT`)."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TensorParallel(rank, world_size, dist.group.WORLD, control)


def broadcast_from_rank0(tp: TensorParallel, obj: object = None) -> object:
    """Rank 0's ``obj`` on every rank (pickled, over the control group)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
    return box[0]


def shutdown_tensor_parallel() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
