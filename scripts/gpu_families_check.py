"""Issue 38's dense families on the GPU: greedy equality with transformers on random weights at real head sizes,
and the per-parameter throughput rate of two ShareGPT runs.

    python scripts/gpu_families_check.py greedy --out families.json            # on the GPU (H200), ~2 min
    python scripts/gpu_families_check.py greedy --device cpu --small            # the same code path on the CPU
    python scripts/gpu_families_check.py rate --runs qwen3.json llama3.json     # after `gpu_engine_bench.sh families`

``greedy``: per family (Mistral, Gemma 2, Gemma 3, Phi-3, Qwen3), transformers' own class builds a few-layer
model with the family's real head size (128; Gemma's 256; Phi-3's 96) and random weights, saves it, and both
transformers and sluice (its defaults: Triton kernels, CUDA graphs, fused kernels) generate greedily for prompts
longer than the sliding windows, in one batch. A token counts as equal when it is transformers' own; a family
passes when every token the engine picked is transformers' best there or within ``--tol`` of it, teacher-forced
along the engine's tokens (random weights make near ties; in bf16, rounding moves them). One line per family, and
JSON with every row. ``--dtype`` (default float32: exact kernels make any difference a bug) selects the engine's
and transformers' dtype.

``rate``: ShareGPT runs' output tok/s times their model's parameter count (built on the meta device), so models
of different sizes compare on one scale; issue 38 asks Qwen3-8B's within 5% of Llama-3-8B's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NEW_TOKENS = 32


def family_configs(small: bool) -> dict:
    """family -> transformers config: real head sizes (small: CPU-sized), windows shorter than the prompts."""
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Phi3Config, Qwen3Config

    window = 24 if small else 256
    scale = 4 if small else 1  # small: hidden and head sizes / 4

    def base(head_dim: int, heads: int = 8, kv: int = 2, layers: int = 4) -> dict:
        return dict(
            vocab_size=49152,  # the borrowed tokenizer's
            hidden_size=heads * head_dim // scale,
            intermediate_size=3 * heads * head_dim // scale,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim // scale,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        )

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    gemma = dict(query_pre_attn_scalar=256 // scale, sliding_window=window, tie_word_embeddings=True)
    g3 = Gemma3TextConfig(
        **(base(256, layers=6) | gemma),
        layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"],
        rope_parameters={"sliding_attention": rope, "full_attention": rope | {"rope_theta": 1e6}},
    )
    g3.architectures = ["Gemma3ForCausalLM"]
    phi = base(96) | dict(sliding_window=window, original_max_position_embeddings=4096)
    del phi["head_dim"]  # Phi-3 derives it: hidden / heads
    return {
        "mistral": MistralConfig(**base(128), sliding_window=window, rope_parameters=rope),
        "gemma2": Gemma2Config(
            **(base(256) | gemma), attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rope_parameters=rope
        ),
        "gemma3": g3,
        "phi3": Phi3Config(**phi, rope_parameters=rope | {"partial_rotary_factor": 1.0}),
        "qwen3": Qwen3Config(**base(128), rope_parameters=rope | {"rope_theta": 1e6}),
    }


def save_random_model(config, out_dir: Path, device: str, dtype, seed: int):
    """transformers' model of ``config``, every parameter random (norm weights around 1), saved with the
    default model's tokenizer; returned for reference generation."""
    import torch
    from sluice.core.models.loader import default_tokenizer_dir
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):  # Gemma's are (1 + w): around 0 there, around 1 elsewhere
                p.copy_((0.0 if "Gemma" in type(model).__name__ else 1.0) + 0.1 * noise)
            else:
                p.copy_(noise * (0.5 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.02))
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in Path(default_tokenizer_dir()).iterdir():
        shutil.copy(f, out_dir / f.name)
    return model.to(device=device, dtype=dtype).eval()


def shortfalls(ref, prompt: list[int], ids: list[int], device: str) -> list[float]:
    """Per generated token: transformers' best logit there minus the logit of the token the engine picked."""
    import torch

    with torch.no_grad():
        logits = ref(torch.tensor([prompt + ids], device=device)).logits[0, len(prompt) - 1 : -1].float()
    picked = logits.gather(1, torch.tensor(ids, device=device)[:, None])[:, 0]
    return (logits.max(dim=1).values - picked).tolist()


def check_family(name: str, config, ns, work: Path) -> dict:
    import torch
    from sluice.core import LLM, SamplingParams

    dtype = getattr(torch, ns.dtype)
    d = work / name
    d.mkdir()
    ref = save_random_model(config, d, ns.device, dtype, seed=len(name))
    g = torch.Generator().manual_seed(1)
    lens = [40, 70] if ns.small else [300, 700, 1100]
    prompts = [torch.randint(1000, 40000, (n,), generator=g).tolist() for n in lens]
    with torch.no_grad():
        refs = [
            ref.generate(torch.tensor([p], device=ns.device), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            for p in prompts
        ]  # fmt: skip
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(model=str(d), device=ns.device, dtype=ns.dtype, max_model_len=2048, num_kv_blocks=512) as llm:
        t0 = time.perf_counter()
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        elapsed = time.perf_counter() - t0
    gaps = [max(shortfalls(ref, p, o, ns.device)) for p, o in zip(prompts, outs, strict=True)]
    equal = sum(a == b for o, r in zip(outs, refs, strict=True) for a, b in zip(o, r))
    row = {
        "family": name,
        "architecture": config.architectures[0] if config.architectures else type(ref).__name__,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "sliding_window": getattr(config, "sliding_window", None),
        "prompt_lens": lens,
        "tokens_equal": equal,
        "tokens": NEW_TOKENS * len(prompts),
        "max_shortfall": max(gaps),
        "engine_s": elapsed,
        "pass": max(gaps) <= ns.tol,
    }
    print(
        f"{name:8s} {row['architecture']:20s} head_dim {row['head_dim']} window {row['sliding_window']}: "
        f"{equal}/{row['tokens']} tokens equal, largest shortfall {row['max_shortfall']:.2e} "
        f"{'PASS' if row['pass'] else 'FAIL'}",
        flush=True,
    )
    return row


def greedy(ns) -> int:
    configs = family_configs(ns.small)
    names = ns.families or list(configs)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            rows.append(check_family(name, configs[name], ns, Path(tmp)))
    result = {"device": ns.device, "dtype": ns.dtype, "tol": ns.tol, "rows": rows, "pass": all(r["pass"] for r in rows)}
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=2))
    return 0 if result["pass"] else 1


def num_params(model: str) -> int:
    import torch
    from sluice.core.models.loader import resolve_model
    from sluice.core.models.registry import model_class_for

    source = resolve_model(model)
    with torch.device("meta"):
        m = model_class_for(source.config)(source.config, max_position=16)
    return sum(p.numel() for p in m.parameters())


def rate(ns) -> int:
    rows = []
    for path, model in zip(ns.runs, ns.models, strict=True):
        fig = json.loads(Path(path).read_text())
        n = num_params(model)
        tps = fig["output_tokens_per_s"]
        rows.append({"model": model, "run": path, "params": n, "output_tokens_per_s": tps, "rate": tps * n / 1e9})
        print(f"{model}: {tps:.0f} output tok/s x {n / 1e9:.2f} B parameters = {tps * n / 1e9:.0f}", flush=True)
    ratio = rows[0]["rate"] / rows[1]["rate"]
    print(f"per-parameter rate {rows[0]['model']} / {rows[1]['model']}: {ratio:.3f} (issue 38: >= 0.95)")
    if ns.out:
        Path(ns.out).write_text(json.dumps({"rows": rows, "ratio": ratio, "pass": ratio >= 0.95}, indent=2))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("greedy", help="each family's greedy tokens against transformers'")
    g.add_argument("--device", default="cuda")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--small", action="store_true", help="CPU-sized models (head sizes / 4, window 24)")
    g.add_argument("--families", nargs="*", help="a subset (default: all)")
    g.add_argument("--tol", type=float, default=None, help="largest logit shortfall (default 1e-3; bf16: 0.25)")
    g.add_argument("--out", default=None)
    r = sub.add_parser("rate", help="per-parameter output rate of two throughput runs")
    r.add_argument("--runs", nargs=2, required=True, help="two `sluice bench throughput --out` JSON files")
    r.add_argument("--models", nargs=2, default=["dummy:qwen3-8b", "dummy:llama3-8b"])
    r.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    if ns.cmd == "greedy":
        ns.tol = ns.tol if ns.tol is not None else (1e-3 if ns.dtype == "float32" else 0.25)
        return greedy(ns)
    return rate(ns)


if __name__ == "__main__":
    sys.exit(main())
