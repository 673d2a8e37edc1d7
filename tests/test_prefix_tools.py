"""The hit-rate tools: workloads (shared prefix, multi-turn, JSONL traces), `sluice cache-sim` and
`sluice bench prefix` from the command line."""

from __future__ import annotations

import json

import pytest
from sluice.app.bench.workloads import load_trace, multi_turn, shared_prefix, write_trace
from sluice.app.commands.cache_sim import SimConfig, simulate
from sluice.app.commands.cli import build_parser, main


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
    from sluice.core.frontend.tokenizer import apply_chat_template

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


# ------------------------------------------------------------------------------------------ what cache-sim reports


def _mixed_workload():
    """Short prompts that share a 64-token prefix, and long ones that share a 320-token prefix: both hit, but only
    a pool of more than 400 tokens holds the long ones."""
    from sluice.app.bench.workloads import Workload, WorkloadRequest

    w = shared_prefix(groups=1, prompts_per_group=8, system_len=64, question_len=8, output_len=4, order="grouped")
    long = [WorkloadRequest(list(range(5000, 5320)) + [40000 + i] * 80, 4) for i in range(4)]
    return Workload("mixed", w.requests[:4] + long + w.requests[4:])


def test_a_pool_too_small_never_reads_better_its_rejections_count_as_misses():
    w = _mixed_workload()
    small = simulate(w, SimConfig(num_kv_blocks=8, block_size=16))  # 128 tokens: the 400-token prompts never fit
    large = simulate(w, SimConfig(num_kv_blocks=200, block_size=16))
    assert small.num_rejected == 4 and large.num_rejected == 0
    assert small.rejected_prompt_tokens == 4 * 400
    # counted over the admitted requests only, the small pool would read better: the bug
    assert small.prefix_cache_hits / small.prefix_cache_queries > large.prefix_cache_hits / large.prefix_cache_queries
    assert small.hit_rate == small.prefix_cache_hits / (small.prefix_cache_queries + 1600)
    assert small.hit_rate < large.hit_rate


def test_sweep_reports_the_unbounded_caches_hit_rate_beside_each_pool():
    from sluice.app.bench.workloads import shared_prefix_optimum
    from sluice.app.commands.cache_sim import sweep

    w = shared_prefix(groups=4, prompts_per_group=4, system_len=64, question_len=8, output_len=4, order="interleaved")
    results, best = sweep(w, [6, 10, 20], [16], SimConfig(num_kv_blocks=1))
    hits, queries = shared_prefix_optimum(4, 4, 64, 8, 16)
    assert best[16].hit_rate == pytest.approx(hits / queries)  # nothing evicted: the analytic optimum
    assert best[16].num_kv_blocks == w.max_blocks_touched(16)
    assert all(r.best_hit_rate == best[16].hit_rate for r in results)
    assert all(r.hit_rate <= r.best_hit_rate for r in results)
    assert results[0].hit_rate < best[16].hit_rate  # 6 blocks evict under the interleaved order


def test_per_tenant_figures_add_up_and_salts_never_share():
    """Two tenants send the same prompts under different salts: each hits only its own earlier prompts."""
    w = shared_prefix(groups=1, prompts_per_group=6, system_len=64, question_len=8, output_len=2, order="grouped")
    for i, r in enumerate(w.requests):
        r.cache_salt = "a" if i % 2 else "b"
    r = simulate(w, SimConfig(num_kv_blocks=200, block_size=16))
    assert set(r.tenants) == {"a", "b"}
    assert sum(t.hit_tokens for t in r.tenants.values()) == r.prefix_cache_hits
    assert sum(t.prompt_tokens for t in r.tenants.values()) == r.prefix_cache_queries
    for t in r.tenants.values():  # 3 prompts each: the first misses, the 2 others hit the 64-token prefix
        assert (t.num_requests, t.hit_tokens, t.prompt_tokens) == (3, 2 * 64, 3 * 72)


def test_kv_memory_maps_to_the_pool_the_engine_allocates():
    """The budget -> blocks arithmetic is the engine's own: an engine given the same memory (fp32 on the CPU)
    allocates exactly the blocks cache-sim reports."""
    from sluice.app.commands.cache_sim import blocks_for_memory, kv_bytes_per_token, parse_bytes
    from sluice.core import LLM
    from sluice.core.models.loader import resolve_model

    config = resolve_model("dummy:smollm2-135m").config
    assert kv_bytes_per_token(config, "bf16") == 2 * 30 * 3 * 64 * 2  # K and V, 30 layers, 3 KV heads of 64
    assert blocks_for_memory(config, "bf16", 16, parse_bytes("1GiB")) == 2**30 // (23040 * 16)
    assert blocks_for_memory(config, "fp8", 16, parse_bytes("1GiB")) == 2 * (2**30 // (23040 * 16)) + 1
    tiny = resolve_model("dummy:tiny").config
    with LLM(model="dummy:tiny", device="cpu", cpu_kv_cache_gib=0.01, max_model_len=256) as llm:
        allocated = llm.engine.stats().kv_blocks_total
    assert allocated == blocks_for_memory(tiny, "fp32", 16, int(0.01 * 2**30))
    with pytest.raises(Exception, match="4GiB"):
        parse_bytes("4 gigs")


def test_cache_sim_command_takes_a_memory_budget_and_prints_the_pool(capsys):
    argv = ["cache-sim", "--model", "dummy:smollm2-135m", "--groups", "2", "--prompts-per-group", "2"]
    argv += ["--system-len", "32", "--question-len", "8", "--output-len", "2", "--kv-memory", "1MiB,2MiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "23,040 bytes per token" in out
    assert "1.00 MiB = 2 blocks of 16 = 32 tokens" in out and "2.00 MiB = 5 blocks of 16 = 80 tokens" in out


def test_sim_trace_replays_as_a_workload(tmp_path):
    """`cache-sim --record-trace` writes the requests it replayed in the trace format `--trace` reads."""
    w = shared_prefix(groups=2, prompts_per_group=3, system_len=32, question_len=8, output_len=3)
    w.requests[1].cache_salt = "t"
    path = tmp_path / "sim.jsonl"
    first = simulate(w, SimConfig(num_kv_blocks=40, block_size=16), trace=str(path))
    back = load_trace(path)
    assert sorted(r.prompt_token_ids for r in back.requests) == sorted(r.prompt_token_ids for r in w.requests)
    assert {tuple(r.prompt_token_ids): r.cache_salt for r in back.requests} == {
        tuple(r.prompt_token_ids): r.cache_salt for r in w.requests
    }
    assert all(r.output_len == 3 for r in back.requests)
    again = simulate(back, SimConfig(num_kv_blocks=40, block_size=16))
    assert again.prefix_cache_hits == first.prefix_cache_hits
