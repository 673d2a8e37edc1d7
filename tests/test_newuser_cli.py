"""The CLI as a new user meets it (issue 42): `bench prefix --trace` shows progress and each phase's figures as
it ends and replays as fast as possible on request, `chat` is quiet with a pool for one conversation, `bench host
--baseline` outside a git checkout is one line."""

from __future__ import annotations

import json

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
