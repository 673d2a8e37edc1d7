"""The hit-rate tools: workloads (shared prefix, multi-turn, JSONL traces), `sluice cache-sim` and
`sluice bench prefix` from the command line."""

from __future__ import annotations

import json

import pytest
from sluice.app.bench.workloads import load_trace, multi_turn, shared_prefix, write_trace
from sluice.app.cache_sim import SimConfig, simulate
from sluice.app.cli import build_parser, main


def test_shared_prefix_prompts_share_exactly_their_system_prompt():
    w = shared_prefix(groups=3, prompts_per_group=4, system_len=20, question_len=5, output_len=2, order="grouped")
    assert len(w.requests) == 12 and all(len(r.prompt_token_ids) == 25 for r in w.requests)
    for g in range(3):
        grp = [r.prompt_token_ids for r in w.requests[4 * g : 4 * g + 4]]
        assert all(p[:20] == grp[0][:20] for p in grp)
        assert len({p[20] for p in grp}) == 4  # questions differ from their first token on
    assert len({w.requests[4 * g].prompt_token_ids[0] for g in range(3)}) == 3
    inter = shared_prefix(
        groups=3, prompts_per_group=4, system_len=20, question_len=5, output_len=2, order="interleaved"
    )
    assert [r.prompt_token_ids[:20] for r in inter.requests[:3]] == [
        w.requests[4 * g].prompt_token_ids[:20] for g in range(3)
    ]


def test_trace_round_trip_and_errors(tmp_path):
    w = shared_prefix(2, 3, 10, 3, output_len=4)
    w.requests[1].after = 0
    w.requests[2].cache_salt = "t"
    w.requests[3].arrival_time = 0.25
    path = tmp_path / "trace.jsonl"
    write_trace(path, w)
    back = load_trace(path)
    assert back.requests == w.requests

    bad = tmp_path / "bad.jsonl"
    for line, field in [
        ('{"prompt_token_ids": [1, 2], "output_len": 0}', "output_len"),
        ('{"output_len": 3}', "prompt_token_ids"),
        ('{"prompt_token_ids": [1], "after": 0}', "after"),
        ('{"prompt_token_ids": [1], "arrival_time": -1}', "arrival_time"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "tokenizer"),
        ("not json", "not JSON"),
    ]:
        bad.write_text(line + "\n")
        with pytest.raises(ValueError, match=field) as e:
            load_trace(bad)
        assert "bad.jsonl:1" in str(e.value)


def test_trace_messages_go_through_the_chat_template(tmp_path, default_tokenizer):
    from sluice.core.tokenizer import apply_chat_template

    msgs = [{"role": "user", "content": "Name three rivers."}]
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"messages": msgs, "max_tokens": 5}) + "\n" + json.dumps({"prompt": "Hello"}) + "\n")
    w = load_trace(path, default_tokenizer, default_output_len=7)
    assert w.requests[0].prompt_token_ids == apply_chat_template(default_tokenizer, msgs)
    assert [r.output_len for r in w.requests] == [5, 7]


def fake_chat(messages: list[dict]) -> list[int]:
    """An append-only template: each message is a role token, one token per word, an end token."""
    ids = []
    for m in messages:
        ids += [1 if m["role"] == "user" else 2] + [100 + len(w) for w in m["content"].split()] + [3]
    return ids + [2]  # the generation prompt


def test_multi_turn_prompts_hold_the_history_and_wait_for_the_previous_turn():
    convs = [["a b c", "d e", "f g h i", "j"], ["k", "l m n o p", "q"]]
    w = multi_turn(fake_chat, convs, max_output_len=3, encode_text=lambda t: [100 + len(x) for x in t.split()])
    assert len(w.requests) == 4
    r0, r1, r2, r3 = w.requests
    assert (r0.after, r1.after, r2.after, r3.after) == (None, 0, None, 2)
    hist = r0.prompt_token_ids[:-1] + [2] + r0.reply_token_ids + [3]
    assert r1.prompt_token_ids[: len(hist)] == hist
    assert [r.output_len for r in w.requests] == [2, 1, 3, 1]  # the replies' lengths, capped at 3, at least 1


def test_cache_sim_with_recorded_replies_hits_the_previous_reply():
    convs = [[" ".join(["w"] * 30), " ".join(["r" * 2] * 40), "x y", "z"]]
    w = multi_turn(fake_chat, convs, max_output_len=64, encode_text=lambda t: [100 + len(x) for x in t.split()])
    plain = simulate(w, SimConfig(num_kv_blocks=64, block_size=8))
    recorded = simulate(w, SimConfig(num_kv_blocks=64, block_size=8, recorded_replies=True))
    assert plain.num_finished == recorded.num_finished == 2
    # the second turn's prompt: 32 tokens of turn one, then "2 + reply + 3"; with the recorded reply the
    # fake model wrote exactly those tokens, so the blocks holding the reply hit as well
    assert recorded.prefix_cache_hits > plain.prefix_cache_hits > 0


def test_cache_sim_command_prints_a_table_and_draws_the_plot(tmp_path, capsys):
    png, out = tmp_path / "hit.png", tmp_path / "sim.json"
    argv = ["cache-sim", "--groups", "4", "--prompts-per-group", "3", "--system-len", "64", "--question-len", "8"]
    argv += ["--output-len", "4", "--block-sizes", "16,32", "--plot", str(png), "--out", str(out)]
    assert main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rec = json.loads(out.read_text())
    rates = {(r["block_size"], r["num_kv_blocks"]): r["hit_rate"] for r in rec["results"]}
    assert {bs for bs, _ in rates} == {16, 32}
    biggest = max(rates)
    assert rates[biggest] == pytest.approx(4 * 2 * 64 / (12 * 72))  # the optimum with the largest pool
    assert "hit_rate" in capsys.readouterr().out


def test_bench_prefix_runs_cache_on_and_off(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "prefix", "--groups", "2", "--prompts-per-group", "3", "--system-len", "40"]
    argv += ["--question-len", "5", "--output-len", "2", "--model", "dummy:tiny", "--device", "cpu"]
    argv += ["--num-kv-blocks", "64", "--max-model-len", "256", "--out", str(out)]
    ns = build_parser().parse_args(argv)
    assert ns.bench_command == "prefix"
    assert main(argv) == 0
    rec = json.loads(out.read_text())
    s = rec["summary"]
    assert s["cache_off"]["hit_rate"] == 0.0
    assert s["cache_on"]["hit_rate"] == s["optimal_hit_rate"] == 2 * 2 * 32 / (6 * 45)
    assert {r["prefix_caching"] for r in rec["runs"]} == {True, False}
    assert all(r["num_failed"] == 0 and r["output_tokens"] == 12 for r in rec["runs"])
    assert rec["machine"]["cores"] >= 1 and rec["model"] == "dummy:tiny"
    printed = capsys.readouterr().out
    assert "throughput cache on / off" in printed and "ttft_p50_s" in printed
