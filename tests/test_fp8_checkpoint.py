"""FP8 checkpoints as Hugging Face writes them (`core/models/fp8_checkpoint.py`), on tiny checkpoints written here
(e4m3 weights and their scales in safetensors beside a config with ``quantization_config``), and fp8 under tensor
parallelism (two gloo ranks, the CPU emulation)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from sluice.core.errors import ModelLoadError
from sluice.core.models.fp8_linear import Fp8Linear, quantize_weight
from sluice.core.models.loader import load_model, resolve_model
from sluice.core.models.parallel import TensorParallel

from tests.helpers import prompt_of_length, save_tiny_hf_model, tiny_hf_config

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory, default_tokenizer):
    d = tmp_path_factory.mktemp("dense")
    save_tiny_hf_model(tiny_hf_config("llama", len(default_tokenizer)), d, default_tokenizer, seed=3)
    return d


def write_fp8(dense: Path, out: Path, granularity: str, qc_extra: dict | None = None) -> dict[str, tuple]:
    """``dense``'s checkpoint with every projection as e4m3 codes + ``weight_scale`` (per ``tensor`` or per
    ``channel``, ``[N, 1]`` as llm-compressor writes it) and an ``input_scale`` to be ignored; returns the codes and
    scales by layer."""
    tensors = load_file(str(dense / "model.safetensors"))
    written = {}
    for name in list(tensors):
        if not name.endswith(".weight") or name.split(".")[-2] not in PROJ:
            continue
        w = tensors.pop(name)
        layer = name[: -len(".weight")]
        if granularity == "tensor":
            scale = (w.abs().amax() / 448).reshape(())
            q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        else:
            q, scale = quantize_weight(w)
            scale = scale[:, None]
        tensors[name], tensors[f"{layer}.weight_scale"] = q, scale
        tensors[f"{layer}.input_scale"] = torch.tensor(1.0)
        written[layer] = (q, scale)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", **(qc_extra or {})}
    (out / "config.json").write_text(json.dumps(config))
    return written


def _rows(scale: torch.Tensor, n: int) -> torch.Tensor:
    return scale.float().reshape(-1).expand(n) if scale.numel() == 1 else scale.float().reshape(-1)


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_fp8_checkpoint_loads_its_own_codes_and_scales(dense_dir, tmp_path, granularity):
    written = write_fp8(dense_dir, tmp_path / granularity, granularity)
    model = load_model(resolve_model(str(tmp_path / granularity)), torch.float32, CPU, 64)
    layer = model.model.layers[1]
    pairs = {
        layer.self_attn.qkv_proj: ("q_proj", "k_proj", "v_proj"),
        layer.self_attn.o_proj: ("o_proj",),
        layer.mlp.gate_up_proj: ("gate_proj", "up_proj"),
        layer.mlp.down_proj: ("down_proj",),
    }
    for mod, parts in pairs.items():
        assert isinstance(mod, Fp8Linear)
        prefix = "model.layers.1." + ("self_attn." if parts[0].endswith(("q_proj", "o_proj")) else "mlp.")
        got = [written[prefix + p] for p in parts]
        codes = torch.cat([q for q, _ in got])
        scales = torch.cat([_rows(s, q.shape[0]) for q, s in got])
        assert torch.equal(mod.qweight.view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(mod.weight_scale, scales)
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 4 * len(model.model.layers)
    assert not isinstance(model.lm_head, Fp8Linear)


def test_fp8_checkpoint_computes_the_dequantized_model_up_to_activation_rounding(dense_dir, tmp_path):
    """Logits of the FP8 checkpoint against a dense model holding its dequantized weights: only the per-token
    activation rounding between them."""
    from sluice.core.models.fp8_linear import fp8_linear_reference

    write_fp8(dense_dir, tmp_path / "fp8", "channel")
    model = load_model(resolve_model(str(tmp_path / "fp8")), torch.float32, CPU, 64)
    lin = model.model.layers[0].mlp.down_proj
    x = torch.randn(5, lin.in_features)
    dense = x @ lin.dequantize(torch.float32).t()
    y = lin(x)
    torch.testing.assert_close(y, fp8_linear_reference(x, lin.qweight, lin.weight_scale, None))
    assert (y - dense).norm() < 0.05 * dense.norm()


def test_block_wise_fp8_checkpoints_are_refused_clearly(dense_dir, tmp_path):
    write_fp8(dense_dir, tmp_path / "blk", "tensor", {"weight_block_size": [128, 128]})
    with pytest.raises(ModelLoadError, match="block-wise"):
        load_model(resolve_model(str(tmp_path / "blk")), torch.float32, CPU, 64)


def test_block_shaped_scales_and_missing_scales_are_refused(dense_dir, tmp_path):
    out = tmp_path / "bad"
    write_fp8(dense_dir, out, "tensor")
    tensors = load_file(str(out / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight_scale"] = torch.ones(2, 3)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="block-wise"):
        load_model(resolve_model(str(out)), torch.float32, CPU, 64)
    del tensors["model.layers.0.mlp.down_proj.weight_scale"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="without a weight_scale"):
        load_model(resolve_model(str(out)), torch.float32, CPU, 64)


def test_tensor_parallel_shards_of_a_per_tensor_checkpoint_keep_the_files_codes(dense_dir, tmp_path):
    """Per-tensor scales need no map of rows: each rank's merged rows take their part's scale."""
    written = write_fp8(dense_dir, tmp_path / "t", "tensor")
    source = resolve_model(str(tmp_path / "t"))
    for r in range(2):
        m = load_model(source, torch.float32, CPU, 64, tp=TensorParallel(r, 2))
        qkv = m.model.layers[0].self_attn.qkv_proj
        attn = m.model.layers[0].self_attn
        q_scale = written["model.layers.0.self_attn.q_proj"][1]
        k_scale = written["model.layers.0.self_attn.k_proj"][1]
        assert torch.equal(qkv.weight_scale[: attn.q_size], _rows(q_scale, attn.q_size))
        assert torch.equal(qkv.weight_scale[attn.q_size : attn.q_size + attn.kv_size], _rows(k_scale, attn.kv_size))
    write_fp8(dense_dir, tmp_path / "c", "channel")
    with pytest.raises(ModelLoadError, match="column-parallel"):
        load_model(resolve_model(str(tmp_path / "c")), torch.float32, CPU, 64, tp=TensorParallel(0, 2))


def _rank_quantizes(rank: int, model_dir: str, port: int, out: str) -> None:
    import torch.distributed as dist
    from sluice.core.models.quant import quantize_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tp = TensorParallel(rank, 2, group=dist.group.WORLD)
        model = load_model(resolve_model(model_dir), torch.float32, CPU, 64, tp=tp)
        quantize_model(model, "fp8")
        mods = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
        torch.save({n: (m.qweight.view(torch.uint8), m.weight_scale) for n, m in mods.items()}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_row_parallel_shards_take_the_whole_rows_scales(dense_dir, tmp_path):
    """Two gloo ranks quantize their shards: o/down (row-parallel) codes put back together, and their scales, are
    the single process's to the bit (the rows' statistics all-reduced at load), and so are the column-parallel MLP
    rows (layer 0: the last layer stays dense)."""
    import socket

    import torch.multiprocessing as mp
    from sluice.core.models.quant import quantize_model

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_quantizes, args=(str(dense_dir), port, str(tmp_path / "q")), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"q.{r}") for r in range(2)]
    one = load_model(resolve_model(str(dense_dir)), torch.float32, CPU, 64)
    quantize_model(one, "fp8")
    for name in ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"):
        whole = one.get_submodule(name)
        assert all(torch.equal(r[name][1], whole.weight_scale) for r in ranks)
        if name.endswith("down_proj"):  # o_proj's columns are heads, in each rank's plan: down's are a plain split
            assert torch.equal(torch.cat([r[name][0] for r in ranks], dim=1), whole.qweight.view(torch.uint8))
    gate_up = one.model.layers[0].mlp.gate_up_proj
    m = gate_up.out_features // 2
    gate = torch.cat([r["model.layers.0.mlp.gate_up_proj"][1][: m // 2] for r in ranks])
    assert torch.equal(gate, gate_up.weight_scale[:m])


def test_two_gloo_ranks_serve_fp8(dense_dir, default_tokenizer):
    """``--quantization fp8`` over two tensor-parallel ranks serves, and its first greedy token of every prompt is
    the single process's best or within a near tie of it. Not always the same: a rank quantizes its slice of a
    row-parallel layer's input per token (no collective on the hot path), a finer scale than the whole row's, so
    logits differ by fp8 rounding, and this random model's top two are often close."""
    from sluice.core import LLM, SamplingParams

    engine = dict(device="cpu", num_kv_blocks=64, block_size=16, max_model_len=256, quantization="fp8")
    prompts = [prompt_of_length(default_tokenizer, n, f"Note {n}:") for n in (1, 17, 40)]
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=4)
    outs = []
    for tp in (1, 2):
        with LLM(model=str(dense_dir), tensor_parallel_size=tp, **engine) as llm:
            outs.append([o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)])
    for one, two in zip(*outs):
        top = {t: lp.logprob for t, lp in one.logprobs[0].items()}
        assert two.token_ids[0] in top and top[one.token_ids[0]] - top[two.token_ids[0]] < 0.05
    assert all(len(o.token_ids) == 16 for o in outs[1]) and len({t for o in outs[1] for t in o.token_ids}) > 5


def test_qwen3_runs_under_fp8(tmp_path, default_tokenizer):
    """Qwen3 (per-head q/k norms between the fp8 qkv projection and RoPE): every projection fp8, the norms dense,
    and the prefill's logits within fp8's error of the dense model's (not equal: it is quantized)."""
    from sluice.app.bench.perplexity import window_logits
    from sluice.core.args import EngineArgs
    from sluice.core.worker.model_runner import ModelRunner
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=len(default_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
    )  # fmt: skip
    save_tiny_hf_model(cfg, tmp_path, default_tokenizer, seed=5)
    source = resolve_model(str(tmp_path))
    ids = prompt_of_length(default_tokenizer, 24)
    logits = {}
    for q in (None, "fp8"):
        args = EngineArgs(model=str(tmp_path), device="cpu", num_kv_blocks=8, max_model_len=64, quantization=q)
        runner = ModelRunner(args, source, 64)
        logits[q] = window_logits(runner, ids)
    attn = runner.model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, Fp8Linear) and attn.q_norm.weight.dtype == torch.float32
    err = (logits["fp8"] - logits[None]).norm() / logits[None].norm()
    # random weights: each projection's output is off by e4m3's rounding of both operands (~4% per element,
    # uncorrelated, so ~5% of a random dot product), compounding over two layers
    assert 1e-5 < err < 0.25
