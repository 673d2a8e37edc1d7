"""Every process ends: a script that never closes its `LLM` (or dies of an exception), `sluice generate` after
an error, and a tensor-parallel script without a main guard. Each runs in a subprocess with a timeout."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TIMEOUT_S = 180  # a cold start of torch and the model on a busy 2-core machine takes ~15 s; a hang takes forever
ENGINE = 'model="dummy:tiny", device="cpu", num_kv_blocks=32, max_model_len=128'


def run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return run([sys.executable, str(script)], tmp_path)


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{cmd} did not exit within {TIMEOUT_S} s; output: {e.stdout!r} {e.stderr!r}")


@pytest.mark.parametrize("ending", ["falls off the end", "raises"])
def test_a_script_that_never_closes_its_llm_exits(tmp_path, ending):
    """vLLM's LLM needs no close(); ours used to keep the process alive at exit, forever."""
    last = 'raise RuntimeError("boom")' if ending == "raises" else 'print("end")'
    proc = run_script(
        tmp_path,
        f"""
        from sluice.core import LLM, SamplingParams

        llm = LLM({ENGINE})
        print(llm.generate(["hi"], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids, flush=True)
        {last}
        """,
    )
    assert proc.stdout.startswith("["), proc.stderr
    if ending == "raises":
        assert proc.returncode == 1 and "RuntimeError: boom" in proc.stderr
    else:
        assert proc.returncode == 0 and proc.stdout.rstrip().endswith("end"), proc.stderr


def test_sluice_generate_exits_with_the_error_after_bad_input(tmp_path):
    """Bad flags, a missing messages file, and an error once the model is loaded (a prompt over
    --max-model-len): each ends the command at once with the message, no traceback."""
    base = [sys.executable, "-m", "sluice.app.commands.cli", "generate", "--model", "dummy:tiny", "--device", "cpu"]
    cases = {
        "max_tokens": [*base, "--prompt", "hi", "--max-tokens", "0"],
        "messages_file": [*base, "--messages-file", str(tmp_path / "missing.json")],
        "prompt": [*base, "--prompt", "word " * 200, "--max-model-len", "16"],
    }
    procs = {k: subprocess.Popen(c, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, c in cases.items()}  # fmt: skip
    try:
        for field, p in procs.items():
            _, err = p.communicate(timeout=TIMEOUT_S)
            assert p.returncode == 2, (field, err)
            assert f"sluice: error: {field}" in err and "Traceback" not in err, err
    except subprocess.TimeoutExpired:
        pytest.fail(f"sluice generate hung: {[k for k, p in procs.items() if p.poll() is None]}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def test_tensor_parallel_script_without_a_main_guard_is_told_what_to_do(tmp_path):
    """Workers are spawned, which re-runs the script's top level: Python's bootstrapping error from inside
    the workers said nothing useful. The engine refuses before spawning, naming the fix."""
    proc = run_script(
        tmp_path,
        f"""
        from sluice.core import LLM

        llm = LLM({ENGINE}, tensor_parallel_size=2)
        """,
    )
    assert proc.returncode == 1
    assert 'if __name__ == "__main__":' in proc.stderr and "line 4 of" in proc.stderr, proc.stderr
    assert "bootstrapping phase" not in proc.stderr
