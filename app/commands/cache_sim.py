"""`sluice cache-sim`: prefix-cache hit rates of a workload for many KV pool sizes and block sizes, in
seconds, without a model.

It replays a workload (`sluice.app.bench.workloads`) through the engine's own `Scheduler` and
`KVCacheManager`, with requests built by the engine's own `make_requests`: admission, chunked prefill,
deferral behind an in-flight prefix, preemption, hashing, LRU eviction and the hit counters are the
engine's code. Only the model is replaced: a fake step "samples" a filler token for every request that
samples (or, with ``recorded_replies``, the reply the workload recorded), and advances a virtual clock by
``step_s + token_s * tokens`` so that arrival times keep their meaning.

Replayed with the same engine settings and the same order of arrivals (one request at a time, say), its
hit rate is the one the real engine measures (`sluice bench prefix`); a test holds them equal.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace

from sluice.app.bench.workloads import Workload
from sluice.app.commands.cache_replay import SimConfig, SimResult, simulate
from sluice.kv.manager import cdiv


def default_pool_sizes(workload: Workload, block_size: int, points: int = 8) -> list[int]:
    """From the smallest pool that holds the longest request to one that never evicts, geometrically."""
    lo = max(cdiv(len(r.prompt_token_ids) + r.output_len, block_size) for r in workload.requests)
    hi = max(lo, workload.max_blocks_touched(block_size))
    if points <= 1 or hi == lo:
        return [hi]
    ratio = (hi / lo) ** (1 / (points - 1))
    return sorted({round(lo * ratio**k) for k in range(points)} | {hi})


def unbounded_replay(workload: Workload, base: SimConfig, block_size: int) -> SimResult:
    """The replay on a pool that holds every request's blocks at once: nothing is ever evicted."""
    unbounded = max(workload.max_blocks_touched(block_size), 1)
    return simulate(workload, SimConfig(**{**asdict(base), "num_kv_blocks": unbounded, "block_size": block_size}))


def sweep(
    workload: Workload, pool_sizes: Sequence[int] | None, block_sizes: Sequence[int], base: SimConfig
) -> tuple[list[SimResult], dict[int, SimResult]]:
    """Every pool size for every block size, and per block size the best possible replay: a pool that holds
    every request's blocks at once, so nothing is ever evicted (the hit rate of an unbounded cache)."""
    out, best = [], {}
    for bs in block_sizes:
        unbounded = max(workload.max_blocks_touched(bs), 1)
        best[bs] = unbounded_replay(workload, base, bs)
        for n in pool_sizes or default_pool_sizes(workload, bs):
            cfg = SimConfig(**{**asdict(base), "num_kv_blocks": n, "block_size": bs})
            result = best[bs] if n == unbounded else simulate(workload, cfg)
            out.append(replace(result, best_hit_rate=best[bs].hit_rate))
    return out, best


def plot_hit_rates(results: Sequence[SimResult], path: str, title: str) -> None:
    """Hit rate against pool size (in tokens, log scale), one line per block size, with the best possible hit rate
    (an unbounded cache) dashed; a pool that had to reject requests is drawn hollow (needs matplotlib:
    ``pip install 'sluice-llm[plot]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'sluice-llm[plot]'") from e
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    any_rejected = False
    for bs in sorted({r.block_size for r in results}):
        rows = sorted((r for r in results if r.block_size == bs), key=lambda r: r.pool_tokens)
        (line,) = ax.plot([r.pool_tokens for r in rows], [100 * r.hit_rate for r in rows], label=f"block {bs}")
        for r in rows:
            hollow = r.num_rejected > 0
            any_rejected |= hollow
            ax.plot(r.pool_tokens, 100 * r.hit_rate, "o", color=line.get_color(), mfc="white" if hollow else None)
        if rows and rows[0].best_hit_rate is not None:
            ax.axhline(
                100 * rows[0].best_hit_rate, ls="--", lw=1, color=line.get_color(), label=f"block {bs}: unbounded"
            )
    ax.set_xscale("log")
    sizes = sorted({r.pool_tokens for r in results})
    if len(sizes) <= 10:  # a tick at every pool size tried
        ax.set_xticks(sizes)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
    ax.xaxis.set_minor_formatter(NullFormatter())  # log-scale minor labels collide
    ax.set_xlabel("KV pool size (tokens)")
    ax.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    ax.set_ylim(0, 100)
    ax.set_title(
        title + ("\nhollow: requests rejected (longer than the pool), counted as misses" if any_rejected else "")
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ memory -> pool size

KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "k": 2**10}
_UNITS |= {"m": 2**20, "g": 2**30, "tb": 10**12, "tib": 2**40, "t": 2**40}


def parse_bytes(text: str) -> int:
    """``"4GiB"``, ``"512MiB"``, ``"2GB"``, ``"8G"`` (binary), ``"1000000"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 4GiB, 512MiB or 2GB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def kv_bytes_per_token(config, kv_dtype: str) -> int:
    """KV cache bytes one token takes in every layer (keys and values) of a model with this config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * KV_DTYPE_BYTES[kv_dtype]


def blocks_for_memory(config, kv_dtype: str, block_size: int, budget: int) -> int:
    """The KV pool, in blocks, that ``budget`` bytes hold (what the engine sizes from the same memory)."""
    return budget // (kv_bytes_per_token(config, kv_dtype) * block_size)


# ------------------------------------------------------------------------------------------ command line


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def _sizes(text: str) -> list[int]:
    return [parse_bytes(x) for x in text.split(",") if x.strip()]


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.2f}%"


def cmd_cache_sim(ns: argparse.Namespace) -> int:
    from sluice.app.bench.results import command_line, print_table, write_result
    from sluice.app.bench.workloads import build_workload
    from sluice.core import envs
    from sluice.core.frontend.tokenizer import load_tokenizer
    from sluice.core.models.loader import resolve_model

    if ns.kv_memory and ns.pool_blocks:
        raise ValueError("give --pool-blocks or --kv-memory, not both")
    t = time.perf_counter()
    source = resolve_model(ns.model, envs.SLUICE_CACHE_DIR)
    workload = build_workload(ns, lambda: load_tokenizer(source.tokenizer_dir), source.config.vocab_size)
    print(f"{workload.name}: {workload.summary()} (built in {time.perf_counter() - t:.1f}s)")
    pool_blocks = ns.pool_blocks
    if ns.kv_memory:
        if len(ns.block_sizes) != 1:
            raise ValueError("--kv-memory takes one --block-sizes")
        bs, per_token = ns.block_sizes[0], kv_bytes_per_token(source.config, ns.kv_dtype)
        pool_blocks = [blocks_for_memory(source.config, ns.kv_dtype, bs, m) for m in ns.kv_memory]
        print(f"KV memory -> pool ({ns.model}, {ns.kv_dtype} KV: {per_token:,} bytes per token):")
        for m, n in zip(ns.kv_memory, pool_blocks):
            size = f"{m / 2**30:,.2f} GiB" if m >= 2**30 else f"{m / 2**20:,.2f} MiB"
            print(f"  {size} = {n:,} blocks of {bs} = {n * bs:,} tokens")
        if not all(pool_blocks):
            raise ValueError("a --kv-memory budget holds not even one block")
    base = SimConfig(
        num_kv_blocks=1,
        enable_prefix_caching=not ns.no_prefix_caching,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        max_model_len=ns.max_model_len,
        max_concurrency=ns.max_concurrency,
        recorded_replies=ns.recorded_replies,
        step_s=ns.step_ms / 1000,
        token_s=ns.token_us / 1e6,
    )
    if ns.replicas > 1:  # data-parallel replicas behind a router (cache_sim_replicas.py)
        from sluice.app.commands.cache_sim_replicas import compare_routings

        if len(ns.block_sizes) != 1 or ns.record_trace:
            raise ValueError("--replicas takes one --block-sizes and no --record-trace")
        base.block_size = ns.block_sizes[0]
        sizes = pool_blocks or [max(1, n // ns.replicas) for n in default_pool_sizes(workload, base.block_size, 4)]
        print_table(compare_routings(workload, base, sizes, ns.replicas, ns.routing))
        return 0
    if ns.record_trace:
        if len(pool_blocks or ()) != 1 or len(ns.block_sizes) != 1:
            raise ValueError("--record-trace replays one configuration: give one --pool-blocks and one --block-sizes")
        base.num_kv_blocks, base.block_size = pool_blocks[0], ns.block_sizes[0]
        best = unbounded_replay(workload, base, base.block_size)  # the table's best_unbounded, as a sweep's
        results = [
            replace(simulate(workload, base, trace=ns.record_trace, model=ns.model), best_hit_rate=best.hit_rate)
        ]
        print(f"wrote {ns.record_trace} (open it with: sluice inspect --trace {ns.record_trace})")
    else:
        results, _ = sweep(workload, pool_blocks, ns.block_sizes, base)
    print_table([_row(r) for r in results])
    for r in results:
        if r.num_rejected:
            print(
                f"{r.num_kv_blocks:,} blocks of {r.block_size}: {r.num_rejected} of {r.num_requests} requests rejected "
                f"(longer than the pool or max_model_len); their {r.rejected_prompt_tokens:,} prompt tokens count "
                "as misses"
            )
    tenants = {name for r in results for name in r.tenants}
    if tenants != {""}:
        print("per tenant (cache_salt):")
        print_table([_tenant_row(r, name) for r in results for name in r.tenants])
    if ns.plot:
        plot_hit_rates(results, ns.plot, f"{workload.name}: {len(workload.requests)} requests")
        print(f"wrote {ns.plot}")
    if ns.out:
        write_result(
            ns.out,
            command_line(),
            "none (cache-sim)",
            workload.summary(),
            {"config": asdict(base), "results": [asdict(r) for r in results]},
        )
        print(f"wrote {ns.out}")
    return 0


def _row(r: SimResult) -> dict:
    return {
        "block_size": r.block_size,
        "num_kv_blocks": r.num_kv_blocks,
        "pool_tokens": r.pool_tokens,
        "hit_rate": _pct(r.hit_rate),
        "best_unbounded": _pct(r.best_hit_rate),
        "prefix_cache_hits": r.prefix_cache_hits,
        "prefix_cache_queries": r.prefix_cache_queries,
        "num_rejected": r.num_rejected,
        "num_preemptions": r.num_preemptions,
        "num_steps": r.num_steps,
        "wall_s": round(r.wall_s, 2),
    }


def _tenant_row(r: SimResult, name: str) -> dict:
    t = r.tenants[name]
    return {
        "block_size": r.block_size,
        "num_kv_blocks": r.num_kv_blocks,
        "tenant": name or "(no salt)",
        "requests": t.num_requests,
        "rejected": t.num_rejected,
        "prompt_tokens": t.prompt_tokens,
        "hit_rate": _pct(t.hit_rate),
    }


def register(subparsers) -> None:
    from sluice.app.bench.workloads import TRACE_FORMAT, add_workload_args
    from sluice.app.commands.cli import DefaultsShownFormatter
    from sluice.core.args import DEFAULT_MODEL

    class Formatter(argparse.RawDescriptionHelpFormatter, DefaultsShownFormatter):
        """The trace format's epilog as written, and every flag's default."""

    p = subparsers.add_parser(
        "cache-sim",
        help="prefix-cache hit rates of a workload for many KV pool and block sizes, without a model",
        description=__doc__.split("\n\n")[0],
        epilog=TRACE_FORMAT,
        formatter_class=Formatter,
    )
    add_workload_args(p)
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="whose tokenizer, vocabulary and KV shape (--kv-memory) the replay uses (default: %(default)s)",
    )
    p.add_argument("--pool-blocks", type=_ints, default=None, help="KV pool sizes in blocks (default: 8 sizes)")
    p.add_argument(
        "--kv-memory",
        type=_sizes,
        default=None,
        metavar="SIZE[,SIZE]",
        help="KV pool sizes as memory, e.g. 2GiB,8GiB: converted to blocks for --model (printed), instead of "
        "--pool-blocks",
    )
    p.add_argument(
        "--kv-dtype",
        choices=sorted(KV_DTYPE_BYTES),
        default="bf16",
        help="the KV cache's element type, for --kv-memory (default: %(default)s, a GPU's; the CPU engine uses fp32)",
    )
    p.add_argument("--block-sizes", type=_ints, default=[16], help="block sizes, e.g. 16,32 (default 16)")
    p.add_argument("--no-prefix-caching", action="store_true", help="replay with the cache off (a baseline)")
    p.add_argument("--max-num-seqs", type=int, default=128, help="as the engine's flag (default: %(default)s)")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="as the engine's flag (default: %(default)s)"
    )
    p.add_argument("--max-model-len", type=int, default=8192, help="as the engine's flag (default: %(default)s)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at once (default: any)")
    p.add_argument(
        "--recorded-replies",
        action="store_true",
        help="the fake model 'generates' each request's recorded reply (traces, ShareGPT), as a deployment "
        "whose history holds its own replies would; off, it generates filler like `bench prefix` does not "
        "match dataset replies",
    )
    p.add_argument("--step-ms", type=float, default=20.0, help="virtual time of one step (for arrival times)")
    p.add_argument("--token-us", type=float, default=500.0, help="virtual time per token in a step")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="data-parallel replicas of --pool-blocks blocks each, against one engine with all their blocks "
        "(sluice serve --data-parallel-size) (default: %(default)s)",
    )
    p.add_argument(
        "--routing",
        type=lambda s: s.split(","),
        default=["kv", "prefix", "least-loaded", "round-robin"],
        help="with --replicas: the routings to compare, e.g. kv,round-robin (default: all four)",
    )
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw hit rate against pool size")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument(
        "--record-trace",
        default=None,
        metavar="FILE",
        help="write the replay's steps and requests (the trace format below; `sluice inspect --trace FILE` shows "
        "it) for one --pool-blocks and --block-sizes",
    )
    p.set_defaults(func=cmd_cache_sim)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="cache-sim")
    register(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["cache-sim", *sys.argv[1:]])
    sys.exit(ns.func(ns))
