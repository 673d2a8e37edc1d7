"""The intra-op thread rule (`core/cpu_threads.py`): --cpu-threads, OMP_NUM_THREADS, affinity and cgroup quota,
the cores kept for the engine's own threads, and the count the engine's step thread actually runs with."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from sluice.app.commands.cli import build_parser, engine_args_from
from sluice.core import LLM, EngineArgs, InvalidRequestError, SamplingParams, cpu_threads, envs
from sluice.core.worker.model_runner import ModelRunner


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A machine of ``cores`` CPUs in this process's affinity, with a v2 cgroup quota when ``quota`` is given."""

    def make(cores: int, quota: str | None = None, v1: tuple[str, str] | None = None) -> None:
        here = Path(tempfile.mkdtemp(dir=tmp_path))  # a fresh machine each call
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
        proc = here / "proc_cgroup"
        proc.write_text("0::/box\n1:cpu,cpuacct:/box\n")
        monkeypatch.setattr(cpu_threads, "PROC_CGROUP", proc)
        root = here / "cgroup"
        (root / "box").mkdir(parents=True)
        (root / "cgroup.controllers").write_text("cpu\n")
        (root / "cpu.max").write_text("max 100000\n")  # the root's: no limit
        if quota is not None:
            (root / "box" / "cpu.max").write_text(quota)
        if v1 is not None:
            (root / "cgroup.controllers").unlink()
            (root / "cpu.max").unlink()
            (root / "box" / "cpu.max").unlink(missing_ok=True)
            v1_dir = root / "cpu,cpuacct" / "box"
            v1_dir.mkdir(parents=True)
            (v1_dir / "cpu.cfs_quota_us").write_text(v1[0])
            (v1_dir / "cpu.cfs_period_us").write_text(v1[1])
        monkeypatch.setattr(cpu_threads, "CGROUP_ROOT", root)

    return make


def test_cores_from_affinity_share_and_reserve(machine):
    machine(2)
    t = cpu_threads.decide()
    assert (t.count, t.source, t.usable_cores, t.reserved_cores) == (2, "cores", 2, 0)  # 2 cores: none kept
    machine(8)
    assert cpu_threads.decide().count == 7  # one kept for the engine's event loops
    assert cpu_threads.decide(ranks=2).count == 3  # each rank's share (4), less one
    assert cpu_threads.decide(ranks=4).count == 2  # a share of 2: nothing kept
    assert cpu_threads.decide(ranks=16).count == 1  # never zero


def test_cgroup_quota_caps_the_affinity(machine):
    machine(8, quota="150000 100000\n")  # 1.5 cores: rounded down
    assert cpu_threads.cgroup_quota_cores(cpu_threads.CGROUP_ROOT) == 1.5
    assert cpu_threads.usable_cores(cpu_threads.CGROUP_ROOT) == 1
    assert cpu_threads.decide().count == 1
    machine(8, quota="50000 100000\n")  # half a core: still one thread
    assert cpu_threads.decide().count == 1
    machine(8, quota="400000 100000\n")
    assert cpu_threads.decide().count == 3  # 4 cores by quota, less one
    machine(2, quota="400000 100000\n")  # the affinity is the smaller
    assert cpu_threads.decide().count == 2
    machine(8, v1=("300000", "100000"))  # cgroup v1
    assert cpu_threads.usable_cores(cpu_threads.CGROUP_ROOT) == 3
    machine(8, v1=("-1", "100000"))  # v1, no quota
    assert cpu_threads.usable_cores(cpu_threads.CGROUP_ROOT) == 8


def test_overrides(machine, monkeypatch):
    machine(8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    t = cpu_threads.decide()
    assert (t.count, t.source) == (3, "OMP_NUM_THREADS")
    t = cpu_threads.decide(requested=5)  # --cpu-threads beats the environment
    assert (t.count, t.source) == (5, "--cpu-threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")  # nested levels: the first is ours
    assert cpu_threads.decide().count == 4
    for bad in ("0", "-2", "many", ""):
        monkeypatch.setenv("OMP_NUM_THREADS", bad)
        assert envs.omp_num_threads() is None
        assert cpu_threads.decide().source == "cores"


def test_cpu_threads_range_is_checked_at_the_edge():
    for bad in (0, -1, (os.cpu_count() or 1) + 1):
        with pytest.raises(InvalidRequestError, match="cpu_threads: must be in \\[1, "):
            EngineArgs(cpu_threads=bad)
    assert EngineArgs(cpu_threads=1).cpu_threads == 1
    ns = build_parser().parse_args(["generate", "--prompt", "hi", "--cpu-threads", "1"])
    assert engine_args_from(ns).cpu_threads == 1
    ns = build_parser().parse_args(["generate", "--prompt", "hi", "--cpu-threads", "0"])
    with pytest.raises(InvalidRequestError, match="cpu_threads"):
        engine_args_from(ns)


def test_importing_sluice_makes_openmp_wait_passively():
    """Set before torch loads OpenMP (it reads the policy once); a caller's own policy is kept."""
    code = (
        "import os, sys, sluice.core; from sluice.core import cpu_threads\n"
        "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["PASSIVE", str(cpu_threads.SPIN_COUNT), "False"]
    for caller in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "7"}):  # the caller's choice stands, alone
        out = subprocess.run([sys.executable, "-c", code], env=env | caller, capture_output=True, text=True, check=True)
        assert out.stdout.split()[:2] == [caller.get("OMP_WAIT_POLICY", "None"), caller.get("GOMP_SPINCOUNT", "None")]


def test_torch_loaded_first_is_told_once_where_threads_are_applied():
    code = (
        "import logging, torch, sluice.core\n"
        "from sluice.core import cpu_threads\n"
        "logging.basicConfig()\n"
        "for _ in range(2): cpu_threads.apply(cpu_threads.CpuThreads(2, 'test', 2, 0))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stderr.count("import sluice.core first, or export OMP_WAIT_POLICY=PASSIVE") == 1


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs to tell two counts apart")
def test_the_engines_step_thread_runs_with_the_decided_count(monkeypatch):
    before = torch.get_num_threads()
    wanted = 1 if before > 1 else 2  # a count this process does not already run with
    seen = []
    for name in ("launch", "execute"):  # the step thread's entry, overlapped or whole
        original = getattr(ModelRunner, name)

        def recording(self, so, _original=original):
            seen.append(torch.get_num_threads())
            return _original(self, so)

        monkeypatch.setattr(ModelRunner, name, recording)
    try:
        with LLM(model="dummy:tiny", device="cpu", num_kv_blocks=16, cpu_threads=wanted) as llm:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {wanted}
