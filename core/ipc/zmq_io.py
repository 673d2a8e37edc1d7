"""ZeroMQ sockets on an anyio event loop (asyncio or trio alike): `recv` waits on the socket's file descriptor.

pyzmq's own asyncio integration would tie the engine to asyncio; the library runs under trio too. A ZeroMQ
socket exposes one file descriptor that becomes readable when the socket's *state* may have changed (it is
edge-triggered), not when a message is there: so the socket's ``EVENTS`` are checked before every wait, and a
wake-up that finds no message waits again. Sends never wait: the pipes are unbounded (``SNDHWM = 0``), and a
send with no peer (the other process is gone) raises `zmq.Again` at once instead of blocking the loop.
"""

from __future__ import annotations

import anyio
import zmq


def socket(ctx: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # closing never waits for a peer that may be dead
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


async def recv(sock: zmq.Socket) -> bytes:
    """The next message; other tasks run while there is none."""
    fd = sock.getsockopt(zmq.FD)
    while True:
        try:
            return sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            pass
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            continue  # a message arrived between the two calls; its edge may already be spent
        await anyio.wait_readable(fd)


def send(sock: zmq.Socket, data: bytes) -> None:
    """Queue ``data`` for the peer; raises `zmq.Again` if there is none."""
    sock.send(data, zmq.NOBLOCK, copy=False)
