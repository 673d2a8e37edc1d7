"""`sluice cache-sim --replicas N --routing ...`: the Ray routers' decisions (`app/ray/policy.py`) replayed over N
replicas' schedulers, against one engine with all their blocks (no Ray needed)."""

from __future__ import annotations

from sluice.app.bench.workloads import shared_prefix
from sluice.app.commands.cache_sim import SimConfig, simulate
from sluice.app.commands.cache_sim_replicas import SWEEP_TIMINGS, seed_sweep, simulate_replicas
from sluice.app.ray.policy import kv_choice, prefix_choice


def test_kv_choice_takes_the_longest_match_within_the_imbalance_bound():
    assert kv_choice([3, 5], [0, 2]) == 1
    assert kv_choice([3, 5], [0, 9], max_imbalance=4) == 0, "too far behind: the least loaded"
    assert kv_choice([0, 0], [3, 1]) == 1, "no match: the least loaded"
    assert kv_choice([5, 5], [2, 1]) == 1, "equal matches: the shorter queue"


def test_prefix_choice_is_rays_prefix_affinity_router():
    assert prefix_choice([3, 30], 36, [500, 900], [2, 3]) == 1, "the longest match"
    assert prefix_choice([3, 2], 36, [500, 900], [2, 1]) == 0, "under a 10% match: the smallest tree"
    assert prefix_choice([3, 30], 36, [500, 900], [0, 9], threshold=8) == 0, "imbalanced: the least loaded"


def test_cache_routing_keeps_the_hit_rate_of_one_engine_with_all_the_blocks():
    # 8 tenants' prefixes of 16 blocks each: 128 blocks, more than one replica's 80
    w = shared_prefix(8, 6, 256, 32, output_len=4, seed=1)
    cfg = SimConfig(num_kv_blocks=80, max_concurrency=4)
    one = simulate(w, SimConfig(num_kv_blocks=160, max_concurrency=4))
    rates = {r: simulate_replicas(w, cfg, 2, r) for r in ("kv", "prefix", "round-robin", "least-loaded")}
    assert all(r.num_finished == len(w.requests) for r in rates.values())
    assert rates["kv"].hit_rate >= 0.9 * one.hit_rate > 0
    assert rates["prefix"].hit_rate >= 0.8 * one.hit_rate
    assert rates["kv"].hit_rate > rates["round-robin"].hit_rate + 0.1
    assert rates["kv"].hit_rate > rates["least-loaded"].hit_rate + 0.1


def test_the_seed_sweep_reports_each_routings_spread_over_seeds_and_timings():
    def workload(seed: int):
        return shared_prefix(8, 6, 256, 32, output_len=4, seed=seed)

    rows = seed_sweep(workload, SimConfig(num_kv_blocks=80, max_concurrency=4), 2, ["kv", "round-robin"], seeds=2)
    by = {r["routing"]: {k: float(v.rstrip("x")) for k, v in r.items() if k.endswith("_vs_one")} for r in rows}
    assert [r["runs"] for r in rows] == [2 * len(SWEEP_TIMINGS)] * 2
    for spread in by.values():
        assert spread["lowest_vs_one"] <= spread["p10_vs_one"] <= spread["mean_vs_one"] <= spread["highest_vs_one"]
    assert by["kv"]["lowest_vs_one"] > by["round-robin"]["highest_vs_one"], by


def test_the_ray_bench_prints_the_simulated_spread_without_an_engine(capsys):
    from sluice.app.ray import bench

    shape = "--groups 4 --prompts-per-group 3 --system-len 64 --question-len 8 --output-len 2 --blocks-per-replica 12"
    assert bench.main([*shape.split(), "--routing", "kv,round-robin", "--sim-seeds", "1", "--sim-only"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("kv ", "round-robin "))}
    assert set(rows) == {"kv", "round-robin"} and all(r[1] == str(len(SWEEP_TIMINGS)) for r in rows.values()), out
    assert "served" not in out, "--sim-only starts no engine"
