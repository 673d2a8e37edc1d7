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
    assert re.search(r"^0 ", out, re.M) and re.search(r"^1 ", out, re.M)  # n=2: both sequences of the chat
    cached, ttft = out.strip().splitlines()[-1].split()
    assert int(cached) >= 0 and float(ttft) > 0


@pytest.mark.slow
def test_tensor_parallel_example(tmp_path):
    """As written: two gloo ranks on the CPU, and no llm.close() (vLLM's LLM needs none): the script exits."""
    out = run_script(tmp_path, block_with("tensor_parallel_size=2"), timeout=300)
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
    (tmp_path / "app").mkdir()  # the user's project has its own app/ package: no clash with sluice's
    (tmp_path / "app" / "__init__.py").write_text("raise ImportError('the user app was imported')\n")
    proc = subprocess.Popen(
        [sys.executable, "myapp.py"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_for(f"http://127.0.0.1:{port}/llm/health", proc)
        home = httpx.get(f"http://127.0.0.1:{port}/").json()
        assert home == {"model": "smollm2-135m-instruct", "running": 0}
        client = block_with("OpenAI(", "include_usage").replace(
            "http://127.0.0.1:8000/v1", f"http://127.0.0.1:{port}/llm/v1"
        )
        out = run_script(tmp_path, client, "client.py")
        assert "completion_tokens=" in out
        # the tool-calling and structured-output examples, against the same server (the real model)
        base = f"http://127.0.0.1:{port}/llm/v1"
        tools = block_with("OpenAI(", "tool_choice").replace("http://127.0.0.1:8000/v1", base)
        tools = tools.replace("max_tokens=100)", "max_tokens=16)")  # its free-text answer: only that it runs
        out = run_script(tmp_path, tools, "tools.py")
        assert "get_weather {'city':" in out, out
        client_line = f'from openai import OpenAI\nc = OpenAI(base_url="{base}", api_key="KEY")\n'
        structured = client_line + block_with("response_format=City")
        out = run_script(tmp_path, structured, "structured.py")
        assert "'population':" in out and "city=" in out, out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_readme_names_only_the_namespace():
    """Every import in the README's examples of sluice names `sluice.`."""
    for block in readme_blocks():
        for line in block.splitlines():
            assert not re.match(r"\s*(from|import) (app|core|kv|spec)\b", line), line


def hit_rate_section() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("## Test your prefix-cache hit rate") : text.index("### The trace format")]


@pytest.mark.slow
def test_hit_rate_walkthrough_figures_come_from_the_committed_trace(tmp_path, capsys):
    """The README's cache-sim command, as written, on the committed trace of the walk-through: its table is the
    one the README shows (the simulator is deterministic), and the files beside it agree."""
    from sluice.app.commands.cli import main

    trace = ROOT / "docs" / "benchmarks" / "hit-rate" / "traffic.jsonl"
    (command,) = re.findall(r"^(sluice cache-sim .*?)\n```", hit_rate_section().replace("\\\n   ", ""), re.M | re.S)
    argv = command.split()[1:]
    argv = [str(trace) if a == "traffic.jsonl" else str(tmp_path / a) if a.endswith(".png") else a for a in argv]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+16\s+\d+\s+[\d,]+\s+[\d.]+%", line)]
    table = [line for line in hit_rate_section().splitlines() if re.match(r"\| \d+ MiB", line)]
    assert len(rows) == len(table) == 6
    for row, line in zip(rows, table):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1:4] == [row[1], row[3], row[4]], (cells, row)  # blocks, hit rate, unbounded
    metrics = (ROOT / "docs" / "benchmarks" / "hit-rate" / "served-metrics.txt").read_text()
    served = re.search(r"^sluice:prefix_cache_hit_rate (\S+)", metrics, re.M).group(1)
    assert f"**{100 * float(served):.2f}%**" in hit_rate_section()
    assert (tmp_path / "cache-sim.png").read_bytes()[:4] == b"\x89PNG"


def test_readme_documents_the_trace_format_that_cache_sim_reads():
    from sluice.app.bench.workloads import TRACE_FORMAT

    text = (ROOT / "README.md").read_text()
    fields = set(re.findall(r'"([a-z_]+)"', TRACE_FORMAT))
    assert fields >= {"arrival_time", "messages", "prompt_token_ids", "output_len", "cache_salt", "after", "type"}
    for name in fields - {"role", "content", "user", "tenant", "a"}:
        assert f"`{name}`" in text or f'"{name}"' in text, name
