"""A server's run directory in the temp directory (the sockets between front end and core, the API servers'
metrics files), named after the process that owns it: ``sluice-core-<pid>-<random>``.

Its owner removes it when it stops; one that is killed (SIGKILL, out of memory) cannot. So each new one first
removes the run directories whose owner is gone. A directory whose owner lives (another server on this machine)
is never touched, nor one whose name carries no owner (made by an older version: its owner is unknown).
"""

from __future__ import annotations

import os
import shutil
import tempfile

# Every kind of run directory sluice makes (`CoreClient`'s, `sluice serve --api-server-count`'s).
PREFIXES = ("sluice-core-", "sluice-serve-")
# A Unix socket's path holds at most 107 bytes (sockaddr_un); the run directory's sockets are named at most
# this long (``to-front-63``), its own name at most ``sluice-serve-<pid>-<8 random>``.
SOCKET_NAME_MAX = 16
SHORT_PARENT = "/tmp"


def run_dir_parent() -> str:
    """The temp directory, unless the sockets' paths in it would be too long for Unix sockets (a deep
    ``TMPDIR``, as a test runner's): then ``/tmp``, where a socket's path always fits."""
    parent = tempfile.gettempdir()
    longest = len(os.fsencode(parent)) + len("/sluice-serve-") + 10 + 1 + 8 + 1 + SOCKET_NAME_MAX
    return parent if longest <= 107 or not os.path.isdir(SHORT_PARENT) else SHORT_PARENT


def make_run_dir(prefix: str) -> str:
    """A new run directory of this process's (``prefix`` one of `PREFIXES`), after removing the orphaned ones."""
    assert prefix in PREFIXES, prefix
    parent = run_dir_parent()
    remove_orphaned_run_dirs(parent)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)


def remove_orphaned_run_dirs(parent: str | None = None) -> list[str]:
    """Remove the run directories in ``parent`` (the temp directory) whose owner is no longer alive; their paths."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        owner = owner_pid(entry.name)
        if owner is None or pid_alive(owner):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue  # gone meanwhile
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def owner_pid(name: str) -> int | None:
    """The owner's pid in a run directory's name (``sluice-core-1234-x8k2_a9q``), or None for any other name."""
    for prefix in PREFIXES:
        if name.startswith(prefix):
            pid, sep, rest = name[len(prefix) :].partition("-")
            # mkdtemp's random part has no "-": a name of an older version ("sluice-core-x8k2_a9q") has no owner
            ok = sep and rest and pid.isascii() and pid.isdigit() and 0 < len(pid) < 10 and int(pid) > 0
            return int(pid) if ok else None
    return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    return True
