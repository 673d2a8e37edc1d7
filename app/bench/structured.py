"""`sluice bench structured`: what enforcing a grammar costs.

Throughput (the default): the same requests (ShareGPT lengths, or random) through one engine, unconstrained and
then every request under a JSON schema, in one run (alternating ``--repeats`` times, medians), greedy with EOS
ignored so both produce the same tokens per request. The schema (`LONG_SCHEMA`) is an array of records with a
large ``minItems``, so no request's grammar ends before its output length: every row of every step is
constrained. Prints both throughputs, their ratio, and the host's time per step filling and uploading the
masks (with the device's time per step beside it, on a GPU).

``--compile`` (the CPU one): the p50 / p99 time to compile a 10-tool "required"-style schema (an array of anyOf
of ``{name: const, arguments: schema}``), each one new (no cache hit): the front end's check and the engine core's
matcher; and the first-token latency of requests one at a time, constrained (a new schema each, so its compiles
count) against unconstrained.
"""

from __future__ import annotations

import argparse
import statistics
import time

from sluice.app.bench.common import (
    add_dataset_args,
    drive_engine,
    engine_args_for,
    load_bench_requests,
    percentiles,
    print_figures,
    release_device_memory,
)
from sluice.app.bench.results import command_line, machine_line, write_result

_RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "new", "old"]}, "maxItems": 3},
        "score": {"type": "number"},
    },
    "required": ["id", "name", "tags", "score"],
    "additionalProperties": False,
}
# no output of a bench request ends it: every row stays constrained to its last token
LONG_SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 100_000, "items": _RECORD}},
    "required": ["records"],
    "additionalProperties": False,
}


def register(sub) -> None:
    from sluice.app.commands.cli import add_engine_args

    p = sub.add_parser("structured", help="structured outputs: throughput under a JSON schema; --compile: CPU costs")
    add_dataset_args(p, default_num_prompts=64)
    p.add_argument("--repeats", type=int, default=2, help="runs of each setting, alternating (medians reported)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="the CPU benchmark instead: compile p99 of a 10-tool schema, first-token latency constrained vs not",
    )
    p.add_argument("--compiles", type=int, default=200, help="--compile: schemas compiled")
    p.add_argument("--first-token-requests", type=int, default=20, help="--compile: requests of each kind")
    p.add_argument("--out", default=None, help="write the JSON result here")
    add_engine_args(p)
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    figures, dataset = compile_figures(ns) if ns.compile else throughput_figures(ns)
    print_figures("structured outputs" + (" (CPU compile)" if ns.compile else ""), figures)
    print(machine_line())
    if ns.out:
        write_result(ns.out, command_line(), ns.model, dataset, figures)
        print(f"wrote {ns.out}")
    return 0


# -- throughput ------------------------------------------------------------------------------------------------
def throughput_figures(ns: argparse.Namespace) -> tuple[dict, dict]:
    import anyio
    from sluice.core import AsyncEngine, StructuredOutputsParams, envs
    from sluice.core.frontend.tokenizer import load_tokenizer
    from sluice.core.models.loader import resolve_model

    source = resolve_model(ns.model, envs.SLUICE_CACHE_DIR)
    requests, dataset = load_bench_requests(ns, load_tokenizer(source.tokenizer_dir), source.config.vocab_size)
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    args = engine_args_for(ns, len(requests), longest)
    schema = StructuredOutputsParams(json=LONG_SCHEMA)
    print(f"structured: {len(requests)} requests, unconstrained vs every one under a JSON schema, {ns.repeats}x each")

    async def go() -> dict[str, list[dict]]:
        runs: dict[str, list[dict]] = {"free": [], "json": []}
        async with AsyncEngine(args) as engine:
            for so in (None, schema):  # warm-up: kernels, and the grammar engine's view of the tokenizer
                await drive_engine(engine, requests[:2], tag="warmup", final_only=True, structured_outputs=so)
            for i in range(ns.repeats):
                for mode in ("free", "json") if i % 2 == 0 else ("json", "free"):
                    f = await _one_run(engine, requests, schema if mode == "json" else None, f"{mode}{i}")
                    runs[mode].append(f)
                    print(f"  run {i + 1} {mode}: {f['output_tokens_per_s']:,.1f} output tok/s")
        return runs

    runs = anyio.run(go)
    release_device_memory()
    return _throughput_summary(runs), dataset


async def _one_run(engine, requests, structured_outputs, tag: str) -> dict:
    before, prof = engine.stats(), engine.host_profile()
    run = await drive_engine(engine, requests, tag=tag, final_only=True, structured_outputs=structured_outputs)
    after = engine.stats()
    steps = max(after.num_steps - before.num_steps, 1)
    per_step = engine.host_profile().since(prof).per_step_ms()
    mask_steps = after.grammar_mask_steps - before.grammar_mask_steps
    return {
        "output_tokens_per_s": sum(run.output_lens) / max(run.elapsed_s, 1e-9),
        "num_steps": steps,
        "mask_ms_per_step": 1e3 * (after.grammar_mask_seconds - before.grammar_mask_seconds) / max(mask_steps, 1),
        "masked_steps": mask_steps,
        "gpu_ms_per_step": per_step.get("gpu", float("nan")),
        "exact_lens": sum(n == r.output_len for n, r in zip(run.output_lens, requests)),
    }


def _throughput_summary(runs: dict[str, list[dict]]) -> dict:
    def med(mode: str, key: str) -> float:
        return statistics.median(f[key] for f in runs[mode])

    free, json_ = med("free", "output_tokens_per_s"), med("json", "output_tokens_per_s")
    mask, gpu = med("json", "mask_ms_per_step"), med("json", "gpu_ms_per_step")
    return {
        "output_tokens_per_s_unconstrained": free,
        "output_tokens_per_s_json_schema": json_,
        "ratio_json_over_unconstrained": json_ / free,
        "mask_fill_apply_ms_per_step": mask,
        "gpu_ms_per_step_json": gpu,
        "mask_share_of_device_time": mask / gpu if gpu == gpu and gpu > 0 else float("nan"),
        "masked_steps_per_run": int(med("json", "masked_steps")),
        "steps_per_run_json": int(med("json", "num_steps")),
        "runs_unconstrained": [f["output_tokens_per_s"] for f in runs["free"]],
        "runs_json_schema": [f["output_tokens_per_s"] for f in runs["json"]],
        "exact_output_lens_json": min(f["exact_lens"] for f in runs["json"]),
    }


# -- compile and first-token latency (CPU) ------------------------------------------------------------------------
def ten_tool_schema(variant: int) -> dict:
    """A "required" tool choice over 10 tools: a non-empty array of calls, each one tool's name and arguments.
    ``variant`` changes a description, so that each schema is new to every cache."""
    kinds = [
        {"type": "string", "maxLength": 64},
        {"type": "integer", "minimum": 0, "maximum": 1000},
        {"enum": ["celsius", "fahrenheit", "kelvin"]},
        {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}, "required": ["lat"]},
        {"type": ["string", "null"]},
        {"type": "boolean"},
        {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]},
        {"type": "number", "minimum": -90, "maximum": 90},
    ]
    calls = []
    for t in range(10):
        props = {f"arg{j}": kinds[(t + j) % len(kinds)] for j in range(3)}
        args = {"type": "object", "properties": props, "required": ["arg0"], "additionalProperties": False}
        name = {"const": f"tool_{t}", "description": f"tool {t}, variant {variant}"}
        calls.append(
            {
                "type": "object",
                "properties": {"name": name, "arguments": args},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def compile_figures(ns: argparse.Namespace) -> tuple[dict, dict]:
    import anyio
    from sluice.core import AsyncEngine, SamplingParams, StructuredOutputsParams

    args = engine_args_for(ns, 1, 64)

    async def go() -> dict:
        async with AsyncEngine(args) as engine:
            backend = engine.grammars
            backend.compile(StructuredOutputsParams(json=ten_tool_schema(-1)))  # the tokenizer's view, once
            check, matcher = [], []
            for i in range(ns.compiles):
                spec = StructuredOutputsParams(json=ten_tool_schema(i))
                t0 = time.perf_counter()
                grammar = backend.compile(spec)
                t1 = time.perf_counter()
                backend.matcher(grammar)
                check.append(t1 - t0)
                matcher.append(time.perf_counter() - t1)
            ttft: dict[str, list[float]] = {"free": [], "json": []}
            prompt = [{"role": "user", "content": "Call a tool."}]
            for i in range(-2, ns.first_token_requests):  # two warm-up rounds
                for mode in ("free", "json"):
                    so = StructuredOutputsParams(json=ten_tool_schema(10_000 + i)) if mode == "json" else None
                    params = SamplingParams(max_tokens=2, temperature=0.0, structured_outputs=so)
                    t0 = time.perf_counter()
                    async for _ in engine.generate(prompt, params):
                        if i >= 0:
                            ttft[mode].append(time.perf_counter() - t0)
                        break
        return {"check": check, "matcher": matcher, "both": [a + b for a, b in zip(check, matcher)], **ttft}

    got = anyio.run(go)
    figures = {
        **percentiles(got["check"], "compile_check"),
        **percentiles(got["matcher"], "compile_matcher"),
        **percentiles(got["both"], "compile_total"),
        **percentiles(got["free"], "first_token_unconstrained"),
        **percentiles(got["json"], "first_token_json"),
    }
    figures["first_token_median_ratio"] = statistics.median(got["json"]) / statistics.median(got["free"])
    return figures, {"name": "10-tool required schema", "compiles": ns.compiles}
