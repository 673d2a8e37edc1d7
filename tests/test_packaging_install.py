"""The README's install commands, as a new user runs them (issue 42): on a machine without an NVIDIA GPU the
documented command resolves torch's CPU build and no CUDA wheel, and building the wheel the way an isolated
`pip install .` does leaves a clean checkout (no `*.egg-info`, no `build/`)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CUDA_NAMES = re.compile(r"^(nvidia|cuda)[-_]", re.I)


def _readme_cpu_install() -> list[str]:
    """The install section's command for a machine without an NVIDIA GPU, as its words."""
    text = (ROOT / "README.md").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("pip install ") and "requirements-cpu.txt" in ln]
    return line.split("#")[0].split()


@pytest.mark.slow
def test_the_documented_cpu_install_resolves_no_cuda_wheel(tmp_path):
    """A dry run of the README's command (`--report`, as if nothing were installed) resolves torch's +cpu build
    and not one nvidia-*/cuda-* wheel. The metadata of the checkout is built in this environment (no build
    isolation) and pip does not retry an index it cannot reach: the resolution is the command's own."""
    words = _readme_cpu_install()
    assert words[:2] == ["pip", "install"]
    report = tmp_path / "report.json"
    extra = ["--dry-run", "--ignore-installed", "--no-build-isolation", "--retries", "0", "--report", str(report)]
    run = subprocess.run(
        [sys.executable, "-m", "pip", *words[1:], *extra, "-q"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    installs = {
        i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]
    }
    assert installs["torch"].endswith("+cpu"), installs["torch"]
    assert "sluice-llm" in installs
    assert not [name for name in installs if CUDA_NAMES.match(name)], sorted(installs)


def _copy_of_the_checkout(dst: Path) -> Path:
    """The files git tracks, as they are in the working tree, in a fresh repository with one commit."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    for cmd in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "copy"]):
        subprocess.run(["git", *cmd], cwd=dst, check=True, capture_output=True)
    return dst


def test_building_the_wheel_as_pip_install_does_leaves_the_checkout_clean(tmp_path):
    """The hooks an isolated `pip install .` (or `pip wheel .`) calls before the build, in its order, on a copy of
    the checkout: afterwards git sees nothing new, ignored files included (``*.egg-info`` is in .gitignore). The
    build itself is tested on the checkout by test_packaging.py."""
    from pip._vendor.pyproject_hooks import BuildBackendHookCaller, quiet_subprocess_runner

    src = _copy_of_the_checkout(tmp_path / "checkout")
    out = tmp_path / "out"
    out.mkdir()
    hooks = BuildBackendHookCaller(
        str(src),
        "build_backend",
        backend_path=["scripts"],
        runner=quiet_subprocess_runner,
        python_executable=sys.executable,
    )
    hooks.get_requires_for_build_wheel()
    metadata = hooks.prepare_metadata_for_build_wheel(str(out))
    hooks.get_requires_for_build_sdist()
    assert metadata.startswith("sluice_llm-") and (out / metadata / "METADATA").is_file()
    status = subprocess.run(
        ["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=src, capture_output=True, text=True
    ).stdout
    assert status == "", status
    assert not list(src.glob("*.egg-info")) and not (src / "build").exists()
