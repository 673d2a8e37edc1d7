"""`sluice bench perplexity`: the accuracy cost of each quantization option, side by side in one run.

Every variant scores the very same token windows of held-out ShareGPT text (the conversations of the
``heldout`` split, turns joined by blank lines, cut into windows of ``--seq-len`` tokens): each window is
one prefill through the engine's own `ModelRunner` (the same model loading, quantization, KV
calibration, KV pool and attention backend that serving uses; with an fp8 KV cache every query reads
the keys and values back from the fp8 pool), and every position after the first is scored. Perplexity =
exp(mean negative log-likelihood over all scored tokens); each variant is reported against the first
(``base``, unquantized) with its bound.

Variants: ``base``; ``fp8-kv`` (``kv_cache_dtype="fp8"``); ``int8``; ``int4`` (``quantization``; on a GGUF
model with Q4_1 projections these are the file's own blocks); ``int4-requant`` (int4 quantized at load
time from the dense weights, as for a model without a GGUF: groups of 128, or 64 where the input size
needs it). The default model is itself a Q4_1 file, so ``int4-requant`` moves weights that already sit on
a 16-level grid per 32-weight block onto a coarser grid per 64/128 weights: it measures that double
rounding on a 135M model, not int4 from 16-bit weights, and has no bound. ``fp8`` (W8A8: e4m3 weights per
output channel, activations per token, the LM head dense; on the CPU the same numerics emulated) and
``fp8+fp8-kv`` (both; reported without a bound of its own); ``fp8`` is `core/models/fp8_recipe.py`'s recipe
(amax / 448 weight scales, the last decoder layer dense), ``fp8-all`` the one before it (every layer fp8), for
before and after in one run; ``fp8-mse-all`` and ``fp8-mse-lastdense`` the same two with the mse weight scales;
``fp8-head`` the recipe with the LM head fp8 too.
"""

from __future__ import annotations

import argparse
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class Variant:
    """One way of loading the model: `EngineArgs` overrides, the issue's bound on its perplexity increase (None:
    shown for information), the fp8 recipe (`core/models/fp8_recipe.py`; None: the process's), whether int4 is
    quantized from the dense weights instead of a GGUF's own blocks, and the tokens per forward pass (None: each
    window in one prefill; a few: the rows of decode steps, which on the CPU take the packed few-row kernels
    instead of the prefill's bf16 GEMMs, `core/models/cpu_linear.py`)."""

    engine: dict[str, Any] = field(default_factory=dict)
    bound_pct: float | None = None
    fp8_recipe: dict[str, Any] | None = None  # `Fp8Recipe`'s fields (torch is imported only to run)
    from_dense: bool = False
    rows: int | None = None


VARIANTS = {
    "base": Variant(),
    "fp8-kv": Variant({"kv_cache_dtype": "fp8"}, 1.0),
    "int8": Variant({"quantization": "int8"}, 1.0),
    "int4": Variant({"quantization": "int4"}, 5.0),
    "int4-requant": Variant({"quantization": "int4"}, from_dense=True),
    "fp8": Variant({"quantization": "fp8"}, 1.5),
    "fp8+fp8-kv": Variant({"quantization": "fp8", "kv_cache_dtype": "fp8"}),
    # the recipe before the dense last layer (every layer fp8), for a side-by-side run
    "fp8-all": Variant({"quantization": "fp8"}, fp8_recipe={"weight_scale": "max", "dense_last_layers": 0}),
    # the recipe with the LM head fp8 too (`SLUICE_FP8_LM_HEAD=1`)
    "fp8-head": Variant({"quantization": "fp8"}, fp8_recipe={"lm_head": True}),
    # the mse weight scales, with every layer fp8 / the last one dense
    "fp8-mse-all": Variant({"quantization": "fp8"}, fp8_recipe={"weight_scale": "mse", "dense_last_layers": 0}),
    "fp8-mse-lastdense": Variant({"quantization": "fp8"}, fp8_recipe={"weight_scale": "mse", "dense_last_layers": 1}),
    # the CPU's default (`--quantization auto`: int4, bf16 activations), scored by prefills and by 4-token steps
    "cpu-auto": Variant({"quantization": "auto"}, 1.0),
    "cpu-auto-rows": Variant({"quantization": "auto"}, 1.0, rows=4),
}
DEFAULT_VARIANTS = "base,fp8-kv,int8,int4,int4-requant,fp8,fp8+fp8-kv"


def register(sub) -> None:
    from sluice.app.commands.cli import add_engine_args

    p = sub.add_parser("perplexity", help="perplexity on held-out ShareGPT text: each quantization option vs none")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"from {', '.join(VARIANTS)}")
    p.add_argument("--num-tokens", type=int, default=16384, help="text tokens to score (whole windows)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window")
    p.add_argument("--out", default=None, help="write the JSON result here")
    add_engine_args(p)
    p.set_defaults(func=main)


def heldout_windows(tokenizer, num_tokens: int, seq_len: int, min_len: int = 64) -> list[list[int]]:
    """Windows of up to ``seq_len`` tokens (at least ``min_len``) from the held-out ShareGPT conversations, in
    file order, until ``num_tokens`` tokens are taken."""
    from sluice.app.bench.datasets import sharegpt_conversations

    windows: list[list[int]] = []
    total = 0
    for turns in sharegpt_conversations(split="heldout"):
        ids = tokenizer("\n\n".join(turns)).input_ids
        for s in range(0, len(ids), seq_len):
            w = ids[s : s + seq_len]
            if len(w) < min_len:
                break
            windows.append(w)
            total += len(w)
            if total >= num_tokens:
                return windows
    if not windows:
        raise ValueError("the held-out ShareGPT split holds no text")
    return windows


def window_logits(runner, ids: list[int], rows: int | None = None):
    """Logits ``[len(ids), vocab]`` (fp32) of every position of ``ids``, prefilled as one sequence from block 0
    of ``runner``'s KV pool (which must hold ``len(ids)`` tokens): in one forward pass, or ``rows`` tokens a pass,
    each over the keys and values of the ones before."""
    import torch

    n = len(ids)
    step = rows or n
    with torch.inference_mode():
        x = torch.tensor(ids, device=runner.device)
        return torch.cat([_chunk_logits(runner, x, s, min(n, s + step)) for s in range(0, n, step)]).float()


def _chunk_logits(runner, ids, start: int, end: int):
    """The logits of positions ``[start, end)``, the KV of ``[0, start)`` already in the pool."""
    import torch
    from sluice.core.models.layers import ForwardContext
    from sluice.kv.attention import AttentionMetadata
    from sluice.kv.manager import cdiv

    dev, q = runner.device, end - start
    meta = AttentionMetadata(
        slot_mapping=torch.arange(start, end, device=dev),
        query_start_loc=torch.tensor([0, q], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([end], dtype=torch.int32, device=dev),
        block_tables=torch.arange(cdiv(end, runner.block_size), dtype=torch.int32, device=dev)[None],
        max_query_len=q,
        max_seq_len=end,
        query_start_loc_host=[0, q],
        seq_lens_host=[end],
    )
    positions = torch.arange(start, end, device=dev)
    hidden = runner.model(ids[start:end], positions, ForwardContext(meta, runner.kv_caches, runner.backend))
    return runner.model.compute_logits(hidden)


def score(runner, windows: list[list[int]], rows: int | None = None) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) of every token after the first of each window, and their count
    (``rows``: `window_logits`)."""
    import torch
    import torch.nn.functional as F

    nll, count = 0.0, 0
    for ids in windows:
        logits = window_logits(runner, ids, rows)[:-1]
        nll += float(F.cross_entropy(logits, torch.tensor(ids[1:], device=logits.device), reduction="sum"))
        count += len(ids) - 1
    return nll, count


def run_variant(name: str, ns: argparse.Namespace, source, windows: list[list[int]]) -> dict:
    import gc

    from sluice.app.commands.cli import engine_args_from
    from sluice.core.models.quant import weight_bytes
    from sluice.kv.manager import cdiv

    variant = VARIANTS[name]
    args = replace(engine_args_from(ns), **variant.engine, num_kv_blocks=cdiv(ns.seq_len, ns.block_size))
    src = replace(source, gguf_file=None) if variant.from_dense else source
    t0 = time.perf_counter()
    runner = load_runner(args, src, ns.seq_len, variant)
    t1 = time.perf_counter()
    nll, count = score(runner, windows, variant.rows)
    fig = {
        "variant": name,
        "kv_cache_dtype": args.kv_cache_dtype,
        "quantization": args.quantization,
        "tokens_per_pass": variant.rows,
        "fp8_layers": fp8_layers(runner.model),
        "weights_gib": weight_bytes(runner.model) / 1024**3,
        "kv_bytes_per_token": runner.kv_bytes_per_block() // runner.block_size,
        "nll_per_token": nll / count,
        "perplexity": math.exp(nll / count),
        "scored_tokens": count,
        "load_s": t1 - t0,
        "score_s": time.perf_counter() - t1,
    }
    del runner
    gc.collect()
    return fig


def load_runner(args, source, max_model_len: int, variant: Variant):
    """The engine's `ModelRunner` for ``variant`` (its fp8 recipe in force while it loads)."""
    from sluice.core.models import fp8_recipe
    from sluice.core.worker.model_runner import ModelRunner

    recipe = variant.fp8_recipe
    with fp8_recipe.recipe_as(fp8_recipe.Fp8Recipe(**recipe)) if recipe else nullcontext():
        return ModelRunner(args, source, max_model_len)


def fp8_layers(model) -> dict[str, Any] | None:
    """How the model's linear layers were quantized to fp8: the weight scale rule(s), and how many linear layers
    are fp8 (the LM head too, where the recipe made it fp8) and how many dense (a dense LM head not counted); None
    without fp8 layers."""
    from sluice.core.models.fp8_linear import Fp8Linear
    from torch import nn

    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    if not fp8:
        return None
    dense = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.endswith("lm_head")]
    rules = sorted({m.weight_scale_rule or "checkpoint" for m in fp8})
    return {"weight_scale": ",".join(rules), "fp8_linear": len(fp8), "dense_linear": len(dense)}


def variant_names(spec: str) -> list[str]:
    """``--variants`` as a list, ``base`` first (added when missing: every figure is against it)."""
    names = [v.strip() for v in spec.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise ValueError(f"variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    return ["base", *(n for n in dict.fromkeys(names) if n != "base")]


def main(ns: argparse.Namespace) -> int:
    from sluice.app.bench.common import print_figures
    from sluice.app.bench.results import command_line, machine_line, print_table, write_result
    from sluice.core import envs
    from sluice.core.frontend.tokenizer import load_tokenizer
    from sluice.core.models.loader import resolve_model

    names = variant_names(ns.variants)
    source = resolve_model(ns.model, envs.SLUICE_CACHE_DIR)
    tokenizer = load_tokenizer(source.tokenizer_dir)
    windows = heldout_windows(tokenizer, ns.num_tokens, ns.seq_len)
    dataset = {
        "name": "sharegpt",
        "split": "heldout",
        "num_windows": len(windows),
        "seq_len": ns.seq_len,
        "tokens": sum(len(w) for w in windows),
    }
    print(f"perplexity: {dataset['tokens']} tokens in {len(windows)} windows of <= {ns.seq_len}; model {ns.model}")
    rows = []
    for name in names:
        fig = run_variant(name, ns, source, windows)
        rows.append(fig)
        print_figures(name, fig)
    base = rows[0]["perplexity"]
    ok = True
    for r in rows:
        r["delta_pct"] = 100 * (r["perplexity"] / base - 1)
        bound = VARIANTS[r["variant"]].bound_pct
        r["bound_pct"] = bound
        r["within_bound"] = None if bound is None else r["delta_pct"] <= bound
        ok &= r["within_bound"] is not False
    print_table(
        rows,
        ["variant", "perplexity", "delta_pct", "bound_pct", "within_bound", "weights_gib", "kv_bytes_per_token"],
    )
    print(machine_line())
    if ns.out:
        write_result(ns.out, command_line(), ns.model, dataset, {"variants": rows, "all_within_bounds": ok})
        print(f"wrote {ns.out}")
    return 0 if ok else 1
