"""The data-parallel benchmark: N replicas of B KV blocks each, per routing, against one engine of N x B blocks, on a
multi-tenant shared-prefix workload whose prefixes do not all fit one replica. Prefix-cache hit rate, throughput
and time to first token, side by side.

    python -m sluice.app.ray.bench --model dummy:tiny --device cpu --replicas 2 --blocks-per-replica 160

Each replica is a full engine with its own core process, reached through `RayEngine` (what the HTTP app of
`sluice serve --data-parallel-backend ray` talks to), so routing, Serve's streaming handles and the replicas are
all measured; HTTP is not. One Ray is started for the whole run (``--ray-address`` joins a cluster instead);
``--cache-sim`` first prints what `sluice cache-sim --replicas` predicts for the same workload, ``--sim-seeds N``
its spread over N workload seeds and a few step timings (a served run is one draw of that spread).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace

import anyio
from sluice.app.bench.prefix import percentile, run_workload
from sluice.app.bench.results import print_table
from sluice.app.bench.workloads import Workload, shared_prefix
from sluice.app.ray.engine import RayConfig, RayEngine
from sluice.app.ray.policy import MAX_IMBALANCE
from sluice.app.ray.route_trace import RouteTrace
from sluice.core import AsyncEngine, EngineArgs

SETTLE_S = 1.5  # the replicas post their counters every half second: wait for the last ones


async def measure(
    name: str, engine, workload: Workload, max_concurrency: int, settle_s: float, trace: str | None = None
) -> dict:
    before = engine.stats()
    if trace is None:
        res = await run_workload(engine, workload, max_concurrency)
    else:
        res = await traced(name, engine, workload, max_concurrency, trace)
    await anyio.sleep(settle_s)
    after = engine.stats()
    q = after.prefix_cache_queries - before.prefix_cache_queries
    h = after.prefix_cache_hits - before.prefix_cache_hits
    ttft, dur = res["ttft"], res["duration_s"]
    split = getattr(engine, "replica_stats", dict)()
    return {
        "routing": name,
        "hit_rate": h / q if q else 0.0,
        "failed": len(res["failed"]),
        "output_tok_per_s": res["output_tokens"] / dur,
        "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
        "ttft_p90_s": percentile(ttft, 90),
        "duration_s": dur,
        "prompt_tokens_per_replica": "/".join(str(s.prefix_cache_queries) for s in split.values()) or "-",
    }


async def traced(name: str, engine, workload: Workload, max_concurrency: int, trace: str) -> dict:
    """`run_workload` with each `kv` decision and each request's hit recorded: the counts printed, the requests
    written to ``{trace}.{name}.jsonl``. Requests are grouped by their first block (a tenant's system prompt)."""
    with RouteTrace() as tracer:
        res = await run_workload(tracer.wrap(engine), workload, max_concurrency)
    if tracer.decisions:
        bs = engine.args.block_size
        groups = {f"bench-{i}": tuple(r.prompt_token_ids[:bs]) for i, r in enumerate(workload.requests)}
        print(f"trace ({name}):", tracer.summary(bs, groups), flush=True)
        tracer.dump(f"{trace}.{name}.jsonl")
    return res


async def bench(ns: argparse.Namespace, args: EngineArgs, workload: Workload) -> list[dict]:
    import ray

    rows = []
    one = replace(args, num_kv_blocks=ns.replicas * ns.blocks_per_replica, engine_core_process=True)
    async with AsyncEngine(one) as engine:
        rows.append(await measure("one engine", engine, workload, ns.max_concurrency, 0.0))
    ray.init(address=ns.ray_address, num_cpus=ns.ray_cpus, include_dashboard=False, log_to_driver=False)
    try:
        each = replace(args, num_kv_blocks=ns.blocks_per_replica)
        for routing in ns.routing:
            # one Serve application per routing: a handle keeps the router it was made with
            config = RayConfig(ns.replicas, routing, max_imbalance=ns.max_imbalance, app_name=f"sluice-{routing}")
            async with RayEngine(each, config) as engine:
                rows.append(await measure(routing, engine, workload, ns.max_concurrency, SETTLE_S, ns.trace))
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    base = rows[0]["hit_rate"]
    for r in rows:
        r["vs_one_engine"] = f"{r['hit_rate'] / base:.2f}x" if base else "-"
        r["hit_rate"] = f"{100 * r['hit_rate']:.1f}%"
        for k in ("output_tok_per_s", "ttft_mean_s", "ttft_p90_s", "duration_s"):
            r[k] = round(r[k], 3)
    return rows


def make_workload(ns: argparse.Namespace, seed: int = 0) -> Workload:
    return shared_prefix(ns.groups, ns.prompts_per_group, ns.system_len, ns.question_len, ns.output_len, seed=seed)


def print_simulated(ns: argparse.Namespace, block_size: int) -> None:
    """What `sluice cache-sim --replicas` predicts for this workload (``--cache-sim``), and its spread over
    workload seeds and step timings (``--sim-seeds``)."""
    from sluice.app.commands.cache_replay import SimConfig
    from sluice.app.commands.cache_sim_replicas import compare_routings, seed_sweep

    base = SimConfig(num_kv_blocks=ns.blocks_per_replica, max_concurrency=ns.max_concurrency, block_size=block_size)
    if ns.cache_sim:
        print("cache-sim:")
        rows = compare_routings(
            make_workload(ns), base, [ns.blocks_per_replica], ns.replicas, ns.routing, ns.max_imbalance
        )
        print_table(rows)
    if ns.sim_seeds:
        print(f"cache-sim over {ns.sim_seeds} workload seeds x step timings (vs one engine with all the blocks):")
        sweep = seed_sweep(
            lambda seed: make_workload(ns, seed),
            base,
            ns.replicas,
            ns.routing,
            ns.sim_seeds,
            max_imbalance=ns.max_imbalance,
        )
        print_table(sweep)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sluice.app.ray.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dummy:tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--blocks-per-replica", type=int, default=160)
    p.add_argument("--routing", type=lambda s: s.split(","), default=["kv", "prefix", "round-robin", "least-loaded"])
    p.add_argument("--groups", type=int, default=16, help="tenants, each with its own system prompt")
    # 1024 requests: at 128, a handful of requests whose prefix is evicted while they wait in a replica's queue
    # moved the ratio to the one engine by several points from run to run (docs/benchmarks/cpu_ray_dp2_dummy_tiny.md)
    p.add_argument("--prompts-per-group", type=int, default=64)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--max-imbalance", type=int, default=MAX_IMBALANCE, help="kv: see app/ray/policy.py")
    p.add_argument("--ray-address", default=None)
    p.add_argument("--ray-cpus", type=int, default=None, help="a local Ray's CPUs (default: the machine's)")
    p.add_argument("--cache-sim", action="store_true", help="print cache-sim's prediction first")
    p.add_argument("--trace", metavar="PREFIX", help="kv: count where the router lost hits, write PREFIX.kv.jsonl")
    p.add_argument(
        "--sim-seeds",
        type=int,
        default=0,
        metavar="N",
        help="print cache-sim's spread over N workload seeds x a few step timings first (0: none)",
    )
    p.add_argument("--sim-only", action="store_true", help="stop after the cache-sim figures (no engine, no Ray)")
    ns = p.parse_args(argv)
    args = EngineArgs(model=ns.model, device=ns.device, max_model_len=4096)
    workload = make_workload(ns)
    if ns.cache_sim or ns.sim_seeds:
        print_simulated(ns, args.block_size)
    if ns.sim_only:
        return 0
    print(f"served ({ns.model}, {ns.device}): {workload.summary()}")
    print_table(anyio.run(bench, ns, args, workload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
