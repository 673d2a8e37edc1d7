"""`sluice serve --api-server-count N`: N front-end processes on one port in front of one engine core.

The process that runs the command supervises and serves nothing itself (vLLM's shape):

* **One port.** It binds the listening socket once and hands it to every front end (spawn passes it on as a
  file descriptor); each front end's uvicorn accepts on it, so the kernel gives each new connection to one of
  them (a busy one is slower to accept, which spreads the load). Then it closes its own copy: when the last
  front end closes the socket at shutdown, the port stops taking connections.
* **One core.** It spawns the engine core (`core/engine_core/process.py`) with a socket pair per front end, and the N
  front ends (`run_api_server`), each with its own request actors, its own bridge to the core (a `CoreClient`
  on a `SharedCore`) and `sluice serve`'s uvicorn server. Processes are spawned, never forked: a forked CUDA
  context is unusable.
* **Metrics.** ``PROMETHEUS_MULTIPROC_DIR`` (a directory of the run's, unless already set) puts the front ends'
  per-request metrics in files that a scrape of any of them sums (`app/server/metrics.py`); the engine's figures come
  from the one core, the same on every front end.
* **Life.** SIGINT or SIGTERM: each front end gets SIGTERM and shuts down as one `sluice serve` does (no new
  connections, `--shutdown-timeout` for what is in flight), telling the core it is done; the core stops once
  every front end has; exit status 0 (a second signal: uvicorn's forced quit). A front end that exits unasked
  takes the whole server down, as vLLM's API servers do: the others are stopped, the core is killed, exit status
  1. A core that dies takes the server down too (exit status 1, for an orchestrator to restart it): each front
  end ends its streams with ``engine_dead`` and stops, as one `sluice serve` does. A supervisor that is killed
  leaves nothing behind: the core and the front ends watch it and end.
"""

from __future__ import annotations

import argparse
import copy
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from sluice.app.server.uvicorn_server import no_delay
from sluice.core import cpu_threads
from sluice.core.args import EngineArgs
from sluice.core.engine_core.process import BridgeAddress, CoreProcessSpec, run_core_process, watch_parent
from sluice.core.errors import InvalidRequestError
from sluice.core.frontend.core_client import STOP_TIMEOUT_S, exit_status
from sluice.core.frontend.engine import AsyncEngine, max_model_len_for
from sluice.core.frontend.engine_core_client import SharedCore
from sluice.core.frontend.run_dir import make_run_dir

logger = logging.getLogger("sluice")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Past --shutdown-timeout, what a front end may still take to stop (its answers go out, its engine stops)
# before it is killed.
STOP_MARGIN_S = 15.0


def check_api_server_count(ns: argparse.Namespace, args: EngineArgs) -> None:
    """Refuse what several front ends cannot do (before anything loads)."""
    n = ns.api_server_count
    if n < 1:
        raise InvalidRequestError(f"api_server_count: must be >= 1, got {n}", param="api_server_count")
    if n == 1:
        return
    if not args.engine_core_process:
        why = "needs the engine core process: drop --no-engine-core-process"
    elif args.enable_inspector or ns.record_trace:
        why = "needs the engine core process, which the inspector (--enable-inspector, --record-trace) turns off"
    elif ns.prefill_device is not None or ns.decode_device is not None:
        why = "is not supported for a prefill/decode pair"
    else:
        return
    raise InvalidRequestError(f"--api-server-count {n} {why}", param="api_server_count")


# -- a front end ----------------------------------------------------------------------------------------------
@dataclass(slots=True)
class ApiServerSpec:
    """What a front-end process is started with (pickled by spawn; the socket and the pipe end travel as file
    descriptors)."""

    index: int
    ns: argparse.Namespace
    args: EngineArgs
    sock: socket.socket  # the listening socket, shared by every front end
    core: SharedCore
    supervisor_pid: int
    log_level: int
    ready: Any  # a multiprocessing Connection: the front end sends its index once it serves


def run_api_server(spec: ApiServerSpec) -> None:
    """A front end's whole life (the target of its spawned process): `sluice serve`'s server on the shared
    socket, until SIGTERM (from the supervisor)."""
    from sluice.app.server.uvicorn_server import build_server

    # Ctrl-C reaches the whole process group: the supervisor turns it into SIGTERM for each front end (uvicorn
    # handles both once it serves; before that, a stray SIGINT would only print a traceback).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tag = f"(APIServer{spec.index} pid={os.getpid()}) "
    logging.basicConfig(level=spec.log_level, format=tag + "%(asctime)s %(levelname)s %(name)s: %(message)s")

    def supervisor_gone() -> None:  # killed: shut down as if told to (its core is gone too), then for certain
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(spec.ns.shutdown_timeout + STOP_MARGIN_S)
        os._exit(1)

    watch_parent(spec.supervisor_pid, supervisor_gone)

    def started() -> None:
        spec.ready.send(spec.index)
        spec.ready.close()

    cpu_threads.apply(cpu_threads.front_end())
    engine = AsyncEngine(spec.args, shared_core=spec.core)  # attaches to the supervisor's core
    server = build_server(spec.ns, engine, log_config=_tagged_log_config(tag), on_started=started)
    server.run(sockets=[spec.sock])  # a failed start exits non-zero inside (uvicorn)
    if server.engine_died:
        sys.exit(1)


def _tagged_log_config(tag: str) -> dict:
    """uvicorn's logging, each line starting with ``tag``: N front ends write to one terminal."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    for formatter in config["formatters"].values():
        formatter["fmt"] = tag + formatter["fmt"]
    return config


# -- the supervisor ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _FrontEnd:
    index: int
    proc: Any  # multiprocessing's SpawnProcess
    ready: Any  # the Connection it says it serves on; None once it has (or has died)


def serve_api_servers(ns: argparse.Namespace, args: EngineArgs) -> int:
    """Run the server as N front ends and a core; the exit status (0: stopped on request, 1: a front end
    failed)."""
    from sluice.core import envs
    from sluice.core.models.loader import resolve_model

    count = ns.api_server_count
    # the core needs it first
    max_model_len = max_model_len_for(args, resolve_model(args.model, envs.SLUICE_CACHE_DIR).config)
    sock = _bind(ns.host, ns.port)
    url = _url(ns.host, sock.getsockname()[1])
    run_dir = make_run_dir("sluice-serve-")  # removes those a killed server left behind
    env_before = os.environ.get(MULTIPROC_ENV)
    if env_before is None:
        os.environ[MULTIPROC_ENV] = os.path.join(run_dir, "metrics")
        os.mkdir(os.environ[MULTIPROC_ENV])
    else:  # the caller's own: used as it is
        logger.warning("%s is set: the API servers' metrics go to %s, which must be emptied between runs (or "
                       "/metrics counts the earlier runs' requests too)", MULTIPROC_ENV, env_before)  # fmt: skip
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    handlers = {sig: signal.signal(sig, lambda *_: _poke(wake_w)) for sig in (signal.SIGINT, signal.SIGTERM)}
    ctx = mp.get_context("spawn")
    core = None
    fronts: list[_FrontEnd] = []
    try:
        bridges = [BridgeAddress(f"ipc://{run_dir}/to-core-{i}", f"ipc://{run_dir}/to-front-{i}") for i in range(count)]
        level = logging.getLogger("sluice").getEffectiveLevel()
        spec = CoreProcessSpec(args, max_model_len, bridges, os.getpid(), level, core_binds=True)
        # Not a daemon: a daemon may not start processes of its own (tensor-parallel workers).
        core = ctx.Process(target=run_core_process, args=(spec,), name="sluice-core", daemon=False)
        core.start()
        for i in range(count):
            ready_r, ready_w = ctx.Pipe(duplex=False)
            shared = SharedCore(i, bridges[i], core.pid)
            front = ApiServerSpec(i, ns, args, sock, shared, os.getpid(), level, ready_w)
            proc = ctx.Process(target=run_api_server, args=(front,), name=f"sluice-api-server-{i}", daemon=False)
            proc.start()
            ready_w.close()
            fronts.append(_FrontEnd(i, proc, ready_r))
        sock.close()  # the front ends hold it now
        logger.info("started the engine core (pid %d) and %d API servers (pids %s)", core.pid, count,
                    ", ".join(str(f.proc.pid) for f in fronts))  # fmt: skip
        return _supervise(core, fronts, wake_r, ns.shutdown_timeout, url)
    finally:
        sock.close()
        for proc in [f.proc for f in fronts] + ([core] if core is not None else []):
            if proc.is_alive():  # only after an error of the supervisor's own: no orphan either way
                proc.kill()
            proc.join(5.0)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.close(wake_r)
        os.close(wake_w)
        if env_before is None:
            del os.environ[MULTIPROC_ENV]
        shutil.rmtree(run_dir, ignore_errors=True)


def _supervise(core, fronts: list[_FrontEnd], wake_fd: int, grace_s: float, url: str) -> int:
    """Wait on the front ends, the core and the signals (see the module's docstring) until every front end has
    exited; then the core is stopped."""
    live = list(fronts)
    num_ready = 0
    stopping = failed = False
    deadline: float | None = None
    core_watched = True
    expected_exits: tuple[int, ...] = (0, -signal.SIGTERM, -signal.SIGINT)

    def stop() -> None:
        nonlocal stopping, deadline
        stopping = True
        deadline = time.monotonic() + grace_s + STOP_MARGIN_S
        for f in live:
            _signal(f.proc, signal.SIGTERM)

    while live:
        waits: list[Any] = [wake_fd, *(f.proc.sentinel for f in live), *(f.ready for f in live if f.ready)]
        if core_watched:
            waits.append(core.sentinel)
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = mp.connection.wait(waits, timeout)
        if wake_fd in ready:
            _drain(wake_fd)
            if not stopping:
                logger.info("shutting down the %d API servers", len(fronts))
                stop()
            else:  # asked again: uvicorn's forced quit (it takes a second SIGINT)
                for f in live:
                    _signal(f.proc, signal.SIGINT)
        for f in live:
            if f.ready is not None and f.ready in ready:
                try:
                    f.ready.recv()
                    num_ready += 1
                except EOFError:
                    pass  # it died before serving; its sentinel says so
                f.ready.close()
                f.ready = None
                if num_ready == len(fronts):
                    logger.info("Uvicorn running on %s with %d API servers (Press CTRL+C to quit)", url, num_ready)
        if core_watched and core.sentinel in ready:
            core.join()
            core_watched = False
            expected_exits += (1,)  # its front ends exit 1 when their core dies
            if not stopping:
                when = "" if num_ready == len(fronts) else " while starting"
                logger.error("the engine core process (pid %d) %s%s: stopping the server", core.pid,
                             exit_status(core.exitcode), when)  # fmt: skip
                failed = True
                stop()
        for f in [f for f in live if f.proc.sentinel in ready]:
            f.proc.join()
            live.remove(f)
            if not stopping:
                logger.error("API server %d (pid %d) %s: stopping the server", f.index, f.proc.pid,
                             exit_status(f.proc.exitcode))  # fmt: skip
                failed = True
                stop()
            elif f.proc.exitcode not in expected_exits:  # not by the signal it was sent
                logger.error("API server %d (pid %d) %s while stopping", f.index, f.proc.pid,
                             exit_status(f.proc.exitcode))  # fmt: skip
                failed = True
        if deadline is not None and live and time.monotonic() >= deadline:
            logger.error("%d API server(s) still running %.0f s after the shutdown began: killing them", len(live),
                         grace_s + STOP_MARGIN_S)  # fmt: skip
            for f in live:
                f.proc.kill()
                f.proc.join()
            live.clear()
            failed = True
    # Each front end that stopped cleanly told the core it was done, and the core stops once all have (it ends
    # the step in flight first); after any other end it waits for a front end that will never say so.
    told = all(f.proc.exitcode == 0 for f in fronts)
    core.join(STOP_TIMEOUT_S if told else 0.0)
    if core.is_alive():
        if told:
            logger.warning("the engine core process (pid %d) did not stop within %.0f s: killing it", core.pid,
                           STOP_TIMEOUT_S)  # fmt: skip
        core.kill()
        core.join(5.0)
    return 1 if failed else 0


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound (as uvicorn binds its own); each front end's uvicorn listens on it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    no_delay(sock)  # uvicorn listens on this socket: its connections as uvicorn's own would be
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _poke(fd: int) -> None:
    try:
        os.write(fd, b"!")
    except BlockingIOError:
        pass  # already poked


def _drain(fd: int) -> None:
    os.set_blocking(fd, False)
    try:
        while os.read(fd, 64):
            pass
    except BlockingIOError:
        pass


def _signal(proc, sig: int) -> None:
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        pass  # just exited; its sentinel says so
