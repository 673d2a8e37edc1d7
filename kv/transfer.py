"""Moving full KV blocks from one engine's pool to another's: prefill/decode disaggregation's wire.

Three parts, all below the engine (they see block ids and KV tensors, never requests):

* `gather_blocks` / `scatter_blocks`: a list of block ids of one pool into one contiguous staging tensor
  ``[layers, 2, n, block_size, kv_heads, head_dim]`` and back out into other block ids of another pool. The
  staging copy is what lets the sender's blocks go back to its pool as soon as they are gathered, whatever
  the network does next, and the receiver's pool is written only once the whole payload has arrived.
* `KVTransport`: a two-rank torch.distributed process group inside this process, rank 0 the sending
  (prefill) side and rank 1 the receiving (decode) side; gloo between CPU pools, NCCL between GPUs. One
  payload at a time, in order (NCCL point-to-point ops match by order, not by tag), each side waited on
  in its own worker thread, so the engines' step loops never wait for the wire.
* failure: a transfer that does not complete within its timeout, or that finds the transport killed
  (`KVTransport.kill`), raises `TransferFailed`. A gloo pair that timed out is closed for good, so a failed
  transfer retires the whole group; the next transfer builds a fresh one (`generation` counts them).
  Whoever asked for the transfer then falls back to recomputing the prompt: a failure costs time, never
  a wrong token, because the receiving pool's blocks are published only after a complete payload.

Only this module knows the transport; swapping in another (NIXL, UCX, a second NCCL communicator per
engine process) changes nothing above it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch


class TransferFailed(RuntimeError):
    """A KV transfer did not complete (timed out, or the transport was killed or broke)."""


@dataclass(slots=True)
class TransferStats:
    """Cumulative counters of a `KVTransport` (read by tests and the pair's stats)."""

    num_transfers: int = 0  # payloads that arrived whole
    num_failed: int = 0
    num_blocks: int = 0  # blocks in the payloads that arrived
    num_bytes: int = 0  # their bytes on the wire
    generation: int = 0  # process groups built so far (a failure retires one)


def _byte_view(kv: torch.Tensor) -> torch.Tensor:
    # index_select / index_copy have no fp8 kernels on every device: move the bytes as bytes
    return kv.view(torch.uint8) if kv.element_size() == 1 and kv.dtype != torch.uint8 else kv


def block_bytes(kv_caches: Sequence[torch.Tensor]) -> int:
    """Bytes of one block over every layer (keys and values)."""
    return sum(kv[:, 0].numel() * kv.element_size() for kv in kv_caches)


def gather_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
    """A contiguous copy of ``block_ids`` of every layer: ``[layers, 2, n, block_size, heads, head_dim]``.
    On a GPU, the caller syncs (its stream) before the blocks may be reused."""
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv_caches[0].device)
    return torch.stack([_byte_view(kv).index_select(1, idx) for kv in kv_caches])


def scatter_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], payload: torch.Tensor) -> None:
    """Write a `gather_blocks` payload into ``block_ids`` of another pool of the same layout."""
    if payload.shape[0] != len(kv_caches) or payload.shape[2] != len(block_ids):
        raise TransferFailed(f"payload of shape {tuple(payload.shape)} does not fit {len(block_ids)} blocks")
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv_caches[0].device)
    for layer, kv in enumerate(kv_caches):
        _byte_view(kv).index_copy_(1, idx, payload[layer].to(kv.device, non_blocking=True))


def payload_shape(kv_caches: Sequence[torch.Tensor], num_blocks: int) -> tuple[int, ...]:
    two, _, *block = kv_caches[0].shape
    return (len(kv_caches), two, num_blocks, *block)


def payload_dtype(kv_caches: Sequence[torch.Tensor]) -> torch.dtype:
    return _byte_view(kv_caches[0]).dtype


class KVTransport:
    """Rank 0 (sending, on ``send_device``) and rank 1 (receiving, on ``recv_device``) of a torch.distributed
    group, both in this process. `transfer` ships one payload; it blocks, so callers run it in a worker
    thread. Transfers are serialized (one at a time, in the order asked)."""

    def __init__(
        self,
        send_device: torch.device,
        recv_device: torch.device,
        timeout_s: float = 30.0,
    ) -> None:
        if (send_device.type == "cuda") != (recv_device.type == "cuda"):
            raise ValueError("both sides of a KV transport must be GPUs, or both the CPU")
        self.send_device = send_device
        self.recv_device = recv_device
        self.timeout_s = timeout_s
        self.stats = TransferStats()
        # Test hook, called on the sending thread just before a payload goes out: a fault injected here
        # (kill the transport, raise, sleep past the timeout) is a transfer that dies on the wire.
        self.fault: Callable[[], None] | None = None
        self._lock = threading.Lock()  # one transfer at a time
        self._groups: tuple[object, object] | None = None
        self._killed = threading.Event()
        self._store = None

    # -- the process group ---------------------------------------------------------------------------
    def _connect(self) -> tuple[object, object]:
        """Build both ranks' groups (each rank's constructor waits for the other: two threads)."""
        import torch.distributed as dist

        if self._store is None:
            self._store = dist.HashStore()
        self.stats.generation += 1
        store = dist.PrefixStore(f"kv-transfer-{self.stats.generation}", self._store)
        timeout = timedelta(seconds=self.timeout_s)
        nccl = self.send_device.type == "cuda"
        groups: list[object] = [None, None]
        errors: list[BaseException] = []

        def make(rank: int) -> None:
            try:
                if nccl:
                    torch.cuda.set_device(self.send_device if rank == 0 else self.recv_device)
                    opts = dist.ProcessGroupNCCL.Options()
                    groups[rank] = dist.ProcessGroupNCCL(store, rank, 2, opts)
                else:
                    groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timeout)
            except BaseException as e:  # noqa: BLE001 - reported below, on the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=make, args=(r,), name=f"kv-connect-{r}") for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout_s)
        if errors or any(g is None for g in groups):
            raise TransferFailed(f"could not build the KV transfer group: {errors[0] if errors else 'timed out'}")
        return groups[0], groups[1]

    def _retire(self) -> None:
        """A failed transfer leaves its ops posted (and a timed-out gloo pair closed): drop the group."""
        self._groups = None

    def kill(self) -> None:
        """Break the transport now: a transfer in flight fails at once (its waits return), as if the link or
        the peer died. The next transfer builds a new group."""
        self._killed.set()

    # -- one payload ---------------------------------------------------------------------------------
    def transfer(self, payload: torch.Tensor) -> torch.Tensor:
        """Ship ``payload`` (on the sending side) and return the received copy (on the receiving side).
        Raises `TransferFailed` on timeout, a kill, or any error of the group; the group is then retired."""
        with self._lock:
            self._killed.clear()
            try:
                if self._groups is None:
                    self._groups = self._connect()
                out = self._transfer(payload)
            except TransferFailed:
                self.stats.num_failed += 1
                self._retire()
                raise
            except Exception as e:
                self.stats.num_failed += 1
                self._retire()
                raise TransferFailed(f"KV transfer failed: {e}") from e
            self.stats.num_transfers += 1
            self.stats.num_blocks += payload.shape[2]
            self.stats.num_bytes += payload.numel() * payload.element_size()
            return out

    def _transfer(self, payload: torch.Tensor) -> torch.Tensor:
        send_pg, recv_pg = self._groups
        payload = payload.contiguous()
        received = torch.empty(payload.shape, dtype=payload.dtype, device=self.recv_device)
        deadline = time.monotonic() + self.timeout_s
        sent: list[object] = []
        send_error: list[BaseException] = []

        def send() -> None:
            try:
                if self.fault is not None:
                    self.fault()
                if self._killed.is_set():
                    return
                if payload.device.type == "cuda":
                    torch.cuda.set_device(payload.device)
                sent.append(send_pg.send([payload], 1, 0))
            except BaseException as e:  # noqa: BLE001 - reported on the caller's thread
                send_error.append(e)
                self._killed.set()  # the receive waits for nothing now

        # The send is issued from its own thread and the receive from this one; each call returns at once and
        # is waited on below. (NCCL builds its communicator on the first op of each rank, and each rank's
        # first op waits for the other's: so they must be issued concurrently, from two threads.)
        sender = threading.Thread(target=send, name="kv-send", daemon=True)
        sender.start()
        if received.device.type == "cuda":
            torch.cuda.set_device(received.device)
        recv_work = recv_pg.recv([received], 0, 0)
        try:
            self._wait(recv_work, deadline)
        finally:
            sender.join(max(0.0, deadline - time.monotonic()))
            if send_error:
                raise TransferFailed(f"KV send failed: {send_error[0]}")
        if sent:
            self._wait(sent[0], deadline)
        if received.device.type == "cuda":
            torch.cuda.synchronize(received.device)  # the receive's stream has written it
        return received

    def _wait(self, work, deadline: float) -> None:
        """Wait for one op, giving up at ``deadline`` or when killed. Neither kind of op can be interrupted:
        a gloo op completes only inside its (blocking) ``wait``, which a helper thread does (it ends at the
        group's own timeout at worst); an NCCL op's ``wait`` does not block the host at all, so its completion
        is polled, a fraction of a millisecond apart at first."""
        if self.send_device.type == "cuda":
            pause = 0.0002
            while not work.is_completed():
                self._check(deadline)
                time.sleep(pause)
                pause = min(pause * 2, 0.005)
            work.wait()  # completed: raises its error, if it failed
            return
        done = threading.Event()
        failure: list[BaseException] = []

        def wait() -> None:
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - reported on the caller's thread
                failure.append(e)
            done.set()

        threading.Thread(target=wait, name="kv-wait", daemon=True).start()
        while not done.wait(0.05):
            self._check(deadline)
        if failure:
            raise TransferFailed(f"KV transfer failed: {failure[0]}")

    def _check(self, deadline: float) -> None:
        if self._killed.is_set():
            raise TransferFailed("KV transfer killed")
        if time.monotonic() > deadline:
            raise TransferFailed(f"KV transfer timed out after {self.timeout_s:g} s")
