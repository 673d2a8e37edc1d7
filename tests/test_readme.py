"""The README's Python examples run as written (on the CPU, with the default model)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)


def block_with(*needles: str) -> str:
    (block,) = [b for b in readme_blocks() if all(n in b for n in needles)]
    return block


def run_script(tmp_path: Path, code: str, name: str = "example.py", timeout: float = 300) -> str:
    path = tmp_path / name
    path.write_text(code)
    run = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(url)


@pytest.mark.slow
def test_offline_example(tmp_path):
    out = run_script(tmp_path, block_with("LLM(model=", "llm.close()"))
    assert "Paris" in out


@pytest.mark.slow
@pytest.mark.parametrize("needle", ["anyio.run(main)", "asyncio.run(main())"])
def test_async_examples(tmp_path, needle):
    out = run_script(tmp_path, block_with("AsyncEngine(", needle))
    assert out.strip()


@pytest.mark.slow
def test_openai_client_and_embedding_examples(tmp_path):
    """The embedding example serves the engine under /llm beside the app's own route; the openai client
    example streams from it (its base URL pointed at that server)."""
    port = free_port()
    app = block_with("Mount(", "uvicorn.run").replace("port=8001", f"port={port}")
    (tmp_path / "myapp.py").write_text(app)
    proc = subprocess.Popen(
        [sys.executable, "myapp.py"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_for(f"http://127.0.0.1:{port}/llm/health", proc)
        home = httpx.get(f"http://127.0.0.1:{port}/").json()
        assert home == {"model": "smollm2-135m-instruct", "running": 0}
        client = block_with("OpenAI(").replace("http://127.0.0.1:8000/v1", f"http://127.0.0.1:{port}/llm/v1")
        out = run_script(tmp_path, client, "client.py")
        assert "completion_tokens=" in out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_readme_names_only_the_namespace():
    """Every import in the README's examples of sluice names `sluice.`."""
    for block in readme_blocks():
        for line in block.splitlines():
            assert not re.match(r"\s*(from|import) (app|core|kv|spec)\b", line), line
