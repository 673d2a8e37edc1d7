"""Run directories in the temp directory carry their owner's pid, and a new one removes those whose owner is gone
(issue 36: a SIGKILLed server left `sluice-core-*` / `sluice-serve-*` folders behind), never a live process's."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from sluice.core.frontend.run_dir import make_run_dir, owner_pid, remove_orphaned_run_dirs, run_dir_parent

from tests.server_helpers import free_port, wait_gone
from tests.test_core_process import child_pids

ROOT = Path(__file__).resolve().parent.parent


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_owner_pid_is_read_from_the_name_only_in_its_own_format():
    assert owner_pid("sluice-core-1234-x8k2_a9q") == 1234
    assert owner_pid("sluice-serve-77-abc") == 77
    assert owner_pid("sluice-core-x8k2_a9q") is None  # an older version's: owner unknown
    assert owner_pid("sluice-core-12345678") is None
    assert owner_pid("sluice-core-99999999999999999999-a") is None
    assert owner_pid("sluice-core--a") is None and owner_pid("sluice-core-0-a") is None
    assert owner_pid("other-1234-abc") is None and owner_pid("sluice-corex-1234-abc") is None


def test_only_the_directories_of_dead_owners_are_removed(tmp_path):
    dead = dead_pid()
    (tmp_path / f"sluice-core-{dead}-aaaa").mkdir()
    (tmp_path / f"sluice-serve-{dead}-bbbb").mkdir()
    (tmp_path / f"sluice-serve-{dead}-bbbb" / "metrics").mkdir()
    keep = [
        f"sluice-core-{os.getpid()}-cccc",  # this process's
        f"sluice-serve-{os.getppid()}-dddd",  # another live process's
        "sluice-core-eeee",  # no owner in its name
        f"other-{dead}-ffff",
    ]
    for name in keep:
        (tmp_path / name).mkdir()
    (tmp_path / f"sluice-core-{dead}-file").write_text("not a directory")
    (tmp_path / f"sluice-core-{dead}-link").symlink_to(tmp_path / keep[0])
    removed = remove_orphaned_run_dirs(str(tmp_path))
    assert sorted(Path(p).name for p in removed) == [f"sluice-core-{dead}-aaaa", f"sluice-serve-{dead}-bbbb"]
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {*keep, f"sluice-core-{dead}-file", f"sluice-core-{dead}-link"}


@pytest.fixture
def short_tmp():
    """A temp directory short enough for the run directory's Unix sockets (pytest's own can be too deep: then
    the server's run directory goes to /tmp, `run_dir_parent`)."""
    path = Path(tempfile.mkdtemp(prefix="rd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_temp_dir_too_deep_for_unix_sockets_gives_way_to_tmp(monkeypatch):
    """A socket's path holds 107 bytes: under a deep TMPDIR (a test runner's, say) the core's sockets could not
    be made and the server failed to start; the run directory then goes to /tmp."""
    deep = "/tmp/" + "d" * 80
    monkeypatch.setattr(tempfile, "tempdir", deep)
    assert run_dir_parent() == "/tmp"
    monkeypatch.setattr(tempfile, "tempdir", "/tmp/short")
    assert run_dir_parent() == "/tmp/short"


def test_a_new_run_dir_is_named_after_its_owner_and_sweeps_the_orphans(short_tmp, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(short_tmp))
    orphan = short_tmp / f"sluice-serve-{dead_pid()}-zzzz"
    orphan.mkdir()
    path = Path(make_run_dir("sluice-core-"))
    assert path.parent == short_tmp and owner_pid(path.name) == os.getpid()
    assert not orphan.exists()
    assert make_run_dir("sluice-serve-") and path.exists()  # this process's own stays


def test_the_folder_a_killed_server_leaves_is_removed_by_the_next_start(short_tmp, monkeypatch):
    """`sluice serve` killed with SIGKILL leaves its `sluice-core-<pid>-*` folder (its core exits by itself); the
    next server's start removes it."""
    port = free_port()
    cmd = [sys.executable, "-m", "sluice.app.commands.cli", "serve", "--model", "dummy:tiny", "--device", "cpu"]
    cmd += ["--port", str(port), "--num-kv-blocks", "64", "--max-model-len", "256"]
    env = {**os.environ, "TMPDIR": str(short_tmp)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        (core,) = child_pids(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        wait_gone(core)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    left = [p for p in short_tmp.iterdir() if p.name.startswith(f"sluice-core-{proc.pid}-")]
    assert len(left) == 1, list(short_tmp.iterdir())
    monkeypatch.setattr(tempfile, "tempdir", str(short_tmp))
    mine = make_run_dir("sluice-core-")
    assert not left[0].exists() and os.path.isdir(mine)
