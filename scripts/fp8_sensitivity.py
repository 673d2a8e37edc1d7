"""Where the fp8 W8A8 perplexity cost comes from, measured on the CPU (issue 39).

Scores held-out ShareGPT windows (`app/bench/perplexity.py`'s) with the unquantized model, then again with
chosen linear layers replaced by a fake-quantized twin that rounds their weights, their activations or both
through e4m3 exactly as `Fp8Linear` would (the dense weight is kept, so each configuration is a module swap, not
a reload). Prints one line per configuration: the perplexity increase over the unquantized model in percent.

    python scripts/fp8_sensitivity.py --study kinds      # each layer kind alone: weights, activations, both
    python scripts/fp8_sensitivity.py --study depth      # each decoder layer alone (all its kinds), W8A8
    python scripts/fp8_sensitivity.py --study ends       # the first two and the last layers' kinds one at a time
    python scripts/fp8_sensitivity.py --study rules      # whole-model W8A8 under each weight/activation rule
    python scripts/fp8_sensitivity.py --study recipes    # whole-model W8A8, mse scales, candidate dense sets
    python scripts/fp8_sensitivity.py --study halves     # max/mse scales x last layer dense or not
    python scripts/fp8_sensitivity.py --study stats      # per-layer relative output error and activation amax

Nothing here is used by the engine; it is the measurement behind `core/models/fp8_linear.py`'s choices.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import replace

import torch
from torch import nn

KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def fake_weight(w: torch.Tensor, rule: str) -> torch.Tensor:
    from sluice.core.models import fp8_linear

    q, s = fp8_linear.quantize_weight(w, rule=rule)
    return fp8_linear.dequantize_weight(q, s, w.dtype)


def fake_act(x: torch.Tensor, rule: str) -> torch.Tensor:
    """``x`` rounded through e4m3 with a scale per row (``max``, what `Fp8Linear` does) or per group of 128
    (``group128``, for comparison only)."""
    from sluice.core.models import fp8_linear

    x2 = x.reshape(-1, x.shape[-1])
    if rule == "group128" and x2.shape[1] % 128 == 0:
        x2 = x2.reshape(-1, 128)
    q, s = fp8_linear.quantize_rows(x2)
    return (q.float() * s[:, None]).to(x.dtype).reshape(x.shape)


ACT_RULES = ("max", "group128")


class FakeFp8(nn.Module):
    """``lin`` with its weight and/or its input rounded through e4m3 (``None``: left as it is)."""

    def __init__(self, lin: nn.Linear, w_rule: str | None, a_rule: str | None) -> None:
        super().__init__()
        self.lin = lin
        self.weight = fake_weight(lin.weight.detach(), w_rule) if w_rule else lin.weight.detach()
        self.a_rule = a_rule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.a_rule:
            x = fake_act(x, self.a_rule)
        return nn.functional.linear(x, self.weight, self.lin.bias)


def linears(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.endswith("lm_head")]


def swap(model: nn.Module, names: list[str], w_rule: str | None, a_rule: str | None) -> dict[str, nn.Module]:
    old = {}
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent)
        old[name] = getattr(owner, attr)
        setattr(owner, attr, FakeFp8(old[name], w_rule, a_rule))
    return old


def restore(model: nn.Module, old: dict[str, nn.Module]) -> None:
    for name, mod in old.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, mod)


class Scorer:
    """Scores the windows; the first call (the unquantized model) keeps its log-probabilities (bf16) so later calls
    also give the mean KL divergence from it, which ranks small perturbations more steadily than perplexity."""

    def __init__(self, runner, windows) -> None:
        self.runner, self.windows = runner, windows
        self.base_logp: list[torch.Tensor] = []
        self.base_nll = self.nll_kl()[0]

    def nll_kl(self) -> tuple[float, float]:
        from sluice.app.bench.perplexity import window_logits

        nll = kl = 0.0
        count = 0
        for i, ids in enumerate(self.windows):
            logp = torch.log_softmax(window_logits(self.runner, ids)[:-1], dim=-1)
            nll -= float(logp.gather(1, torch.tensor(ids[1:])[:, None]).sum())
            if len(self.base_logp) < len(self.windows):
                self.base_logp.append(logp.to(torch.bfloat16))
            else:
                base = self.base_logp[i].float()
                kl += float((base.exp() * (base - logp)).sum())
            count += len(ids) - 1
        return nll / count, kl / count

    def measure(self, label: str, names, w_rule, a_rule) -> float:
        old = swap(self.runner.model, names, w_rule, a_rule)
        try:
            nll, kl = self.nll_kl()
        finally:
            restore(self.runner.model, old)
        delta = 100 * (math.exp(nll - self.base_nll) - 1)
        print(f"{label:48s} ppl {delta:+7.3f}%  KL {1e3 * kl:7.3f}e-3", flush=True)
        return delta


def study_kinds(sc, ns) -> None:
    names = linears(sc.runner.model)
    for kind in (*KINDS, "all"):
        sel = names if kind == "all" else [n for n in names if n.endswith(kind)]
        modes = [("W8A16", ns.w_rule, None), ("W16A8", None, ns.a_rule)]
        for mode, w, a in modes + [("W8A8", ns.w_rule, ns.a_rule)] * (kind == "all"):
            sc.measure(f"{kind} {mode}", sel, w, a)


def study_depth(sc, ns) -> None:
    names = linears(sc.runner.model)
    n_layers = sc.runner.model.config.num_hidden_layers
    for i in range(n_layers):
        sel = [n for n in names if re.search(rf"\.layers\.{i}\.", n)]
        sc.measure(f"layer {i} W8A8", sel, ns.w_rule, ns.a_rule)


def study_ends(sc, ns) -> None:
    names = linears(sc.runner.model)
    n_layers = sc.runner.model.config.num_hidden_layers
    for kind in KINDS:  # the first and last layers' kinds one at a time
        for i in (0, 1, n_layers - 1):
            sel = [n for n in names if re.search(rf"\.layers\.{i}\.", n) and n.endswith(kind)]
            sc.measure(f"layer {i} {kind} W8A8", sel, ns.w_rule, ns.a_rule)


def study_rules(sc, ns) -> None:
    from sluice.core.models.fp8_scales import WEIGHT_SCALE_RULES as WEIGHT_RULES

    names = linears(sc.runner.model)
    for w in WEIGHT_RULES:
        sc.measure(f"all W8A16 weights={w}", names, w, None)
    for a in ACT_RULES:
        sc.measure(f"all W16A8 acts={a}", names, None, a)
    for w in WEIGHT_RULES:
        for a in ACT_RULES:
            sc.measure(f"all W8A8 weights={w} acts={a}", names, w, a)


def study_recipes(sc, ns) -> None:
    """Whole-model W8A8 with the mse weight scales, keeping each candidate set of layers dense."""
    names = linears(sc.runner.model)
    last = sc.runner.model.config.num_hidden_layers - 1
    keep = {
        "none": lambda n: False,
        "layer 0": lambda n: ".layers.0." in n,
        f"layers 0 and {last}": lambda n: ".layers.0." in n or f".layers.{last}." in n,
        "layer 0 down_proj": lambda n: n.endswith(".layers.0.mlp.down_proj"),
        "every qkv_proj": lambda n: n.endswith("qkv_proj"),
    }
    sc.measure("all W8A8 weights=max, dense: none", names, "max", "max")
    for label, dense in keep.items():
        sc.measure(f"all W8A8 weights=mse, dense: {label}", [n for n in names if not dense(n)], "mse", "max")


def study_halves(sc, ns) -> None:
    """The bench's fp8 recipes on the same text: max or mse weight scales, with and without the last layer dense."""
    names = linears(sc.runner.model)
    last = f".layers.{sc.runner.model.config.num_hidden_layers - 1}."
    for dense_last in (False, True):
        sel = [n for n in names if not (dense_last and last in n)]
        for w in ("max", "mse"):
            sc.measure(f"all W8A8 weights={w}, last layer dense: {dense_last}", sel, w, "max")


def study_stats(sc, ns) -> None:
    """Per layer: relative output error of weights-only and activations-only rounding, and the inputs' amax over
    their row's RMS (how far the row's largest value sits above the rest), over the first window."""
    from sluice.app.bench.perplexity import window_logits

    stats: dict[str, list[float]] = {}

    def hook(name):
        def fn(mod, args, out):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            w = mod.weight.float()
            ref = x @ w.t()
            ew = x @ fake_weight(w, ns.w_rule).t() - ref
            ea = fake_act(x, ns.a_rule) @ w.t() - ref
            rms = x.pow(2).mean(dim=1).sqrt().clamp_min(1e-30)
            peak = (x.abs().amax(dim=1) / rms).max()
            denom = ref.norm()
            stats[name] = [float(ew.norm() / denom), float(ea.norm() / denom), float(peak)]

        return fn

    handles = [sc.runner.model.get_submodule(n).register_forward_hook(hook(n)) for n in linears(sc.runner.model)]
    try:
        window_logits(sc.runner, sc.windows[0])
    finally:
        for h in handles:
            h.remove()
    print(f"{'layer':40s} {'rel err W':>10s} {'rel err A':>10s} {'amax/rms':>10s}")
    for name, (ew, ea, peak) in stats.items():
        print(f"{name:40s} {ew:10.4f} {ea:10.4f} {peak:10.1f}")


def main() -> None:
    from sluice.app.bench.perplexity import heldout_windows
    from sluice.core import envs
    from sluice.core.args import EngineArgs
    from sluice.core.frontend.tokenizer import load_tokenizer
    from sluice.core.models.loader import resolve_model
    from sluice.core.worker.model_runner import ModelRunner
    from sluice.kv.manager import cdiv

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--study",
        choices=("kinds", "depth", "ends", "rules", "recipes", "halves", "stats"),
        action="append",
        required=True,
    )
    p.add_argument("--model", default=EngineArgs().model)
    p.add_argument("--num-tokens", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--w-rule", default="max", help="weight scale rule for kinds/depth/stats")
    p.add_argument("--a-rule", default="max", help="activation scale rule for kinds/depth/stats")
    ns = p.parse_args()
    torch.set_num_threads(2)
    source = resolve_model(ns.model, envs.SLUICE_CACHE_DIR)
    windows = heldout_windows(load_tokenizer(source.tokenizer_dir), ns.num_tokens, ns.seq_len)
    args = replace(EngineArgs(model=ns.model, device="cpu"), num_kv_blocks=cdiv(ns.seq_len, 16))
    runner = ModelRunner(args, source, ns.seq_len)
    sc = Scorer(runner, windows)
    print(f"{ns.model}: {sum(map(len, windows))} tokens, base perplexity {math.exp(sc.base_nll):.4f}", flush=True)
    studies = {
        "kinds": study_kinds,
        "depth": study_depth,
        "ends": study_ends,
        "rules": study_rules,
        "recipes": study_recipes,
        "halves": study_halves,
        "stats": study_stats,
    }
    for name in ns.study:
        studies[name](sc, ns)


if __name__ == "__main__":
    main()
