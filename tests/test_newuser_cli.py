"""The CLI as a new user meets it (issue 42): `bench prefix --trace` shows progress and each phase's figures as
it ends and replays as fast as possible on request, `chat` is quiet with a pool for one conversation, `bench host
--baseline` outside a git checkout is one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sluice.app.commands.cli import main

TINY = ("--model", "dummy:tiny", "--device", "cpu")


def test_bench_prefix_trace_shows_progress_and_can_ignore_arrival_times(tmp_path, capsys):
    """The second request arrives two minutes in: replayed as recorded the run would last that long; with
    --ignore-arrival-times both arrive at once. Each phase's line is printed as it ends, under a bar."""
    trace = tmp_path / "traffic.jsonl"
    lines = [
        {"arrival_time": 0.0, "prompt_token_ids": list(range(10, 42)), "output_len": 2},
        {"arrival_time": 120.0, "prompt_token_ids": list(range(10, 50)), "output_len": 2},
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "result.json"
    flags = ("--trace", str(trace), "--ignore-arrival-times", "--out", str(out), "--num-kv-blocks", "32")
    assert main(["bench", "prefix", *flags, *TINY]) == 0
    captured = capsys.readouterr()
    phases = [ln for ln in captured.out.splitlines() if ln.startswith("round 0 cache") and "hit rate" in ln]
    assert len(phases) == 2, captured.out
    assert "2/2" in captured.err  # the bar of each phase, on stderr
    runs = json.loads(out.read_text())["runs"]
    assert [r["prefix_caching"] for r in runs] == [True, False]
    assert all(r["duration_s"] < 60 and r["num_failed"] == 0 for r in runs), runs
    assert json.loads(out.read_text())["dataset"]["ignore_arrival_times"] is True


def test_chat_pool_holds_one_conversation():
    from sluice.app.commands.chat import chat_engine_args
    from sluice.app.commands.cli import build_parser
    from sluice.core.args import MAX_MODEL_LEN_DEFAULT

    parse = build_parser().parse_args
    assert chat_engine_args(parse(["chat", "--max-model-len", "500"])).num_kv_blocks == 32 + 1  # ceil(500/16) + 1
    assert chat_engine_args(parse(["chat", "--block-size", "32"])).num_kv_blocks == MAX_MODEL_LEN_DEFAULT // 32 + 1
    assert chat_engine_args(parse(["chat", "--num-kv-blocks", "100"])).num_kv_blocks == 100  # the flag wins


CHAT_TWICE = """
import io, sys
from sluice.app.commands.cli import main
for flags in (["--verbose"], []):
    sys.stdin = io.StringIO("hi\\n/exit\\n")
    print("=== chat", *flags, file=sys.stderr, flush=True)
    assert main(["chat", "--model", "dummy:tiny", "--device", "cpu", "--max-tokens", "3", *flags]) == 0
"""


def test_chat_is_quiet_unless_verbose():
    """One process (torch imports once) chats with --verbose, then without: only the first shows INFO lines."""
    run = subprocess.run([sys.executable, "-c", CHAT_TWICE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    verbose, quiet = run.stderr.split("=== chat --verbose\n")[1].split("=== chat\n")
    assert run.stdout.count(">>> hi") == 2
    assert " INFO " in verbose  # there is something to hide
    assert " INFO " not in quiet, quiet


def test_chat_line_editing_keeps_history_across_sessions(tmp_path):
    readline = pytest.importorskip("readline")
    from sluice.app.commands.chat import line_editing

    history = tmp_path / "state" / "chat_history"
    readline.clear_history()
    with line_editing(history) as on:
        assert on
        readline.add_history("what is a prefix cache?")
    assert "what is a prefix cache?" in history.read_text()
    readline.clear_history()
    with line_editing(history):  # the next session starts with the last one's lines
        items = [readline.get_history_item(i) for i in range(1, readline.get_current_history_length() + 1)]
    assert items == ["what is a prefix cache?"]


def test_bench_host_baseline_outside_a_git_checkout_is_one_line(tmp_path, monkeypatch, capsys):
    from sluice.app.bench import host

    installed = tmp_path / "site-packages" / "sluice"  # what a pip install has: no .git anywhere above
    installed.mkdir(parents=True)
    monkeypatch.setattr(host, "REPO", installed)
    assert main(["bench", "host", "--baseline", "main", "--rounds", "1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--baseline needs a git checkout" in line and str(installed) in line and "Traceback" not in line
    monkeypatch.undo()
    # in the checkout, a ref git does not know is one line too, before anything runs
    assert main(["bench", "host", "--baseline", "no-such-ref-42", "--rounds", "1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--baseline no-such-ref-42" in line, line


def test_cache_sim_record_trace_fills_best_unbounded(tmp_path, capsys):
    """The one replayed configuration's row says the unbounded pool's hit rate too, as a sweep's rows do: a
    pool of 4 blocks evicts what 2 groups x 3 prompts share, an unbounded one keeps it."""
    out, trace = tmp_path / "result.json", tmp_path / "sim.jsonl"
    argv = ["cache-sim", "--model", "dummy:tiny", "--groups", "2", "--prompts-per-group", "3", "--system-len", "32"]
    argv += ["--question-len", "8", "--output-len", "2", "--pool-blocks", "4", "--block-sizes", "16"]
    assert main([*argv, "--record-trace", str(trace), "--out", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["best_hit_rate"] is not None and result["best_hit_rate"] > result["hit_rate"]
    assert main([*argv, "--out", str(out)]) == 0  # the sweep of the same one size says the same
    (swept,) = json.loads(out.read_text())["results"]
    assert swept["best_hit_rate"] == result["best_hit_rate"]
    assert trace.exists() and "None" not in capsys.readouterr().out
