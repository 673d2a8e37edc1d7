"""EAGLE-1 draft head: ``fc([embed(x_{t+1}); f_t]) -> one Llama decoder layer -> the target's LM head``.

``f_t`` is the target's final (normed) hidden state at position ``t``, the feature its own LM head reads.
The head predicts ``f_{t+1}`` and, through the target's LM head, the token ``x_{t+2}``. It owns only
``fc``, the decoder layer and an optional output norm; the embedding and LM head are the target's.

With ``feature="eagle3"`` the target's features are EAGLE-3's instead: the hidden states after a low, a
middle and a high decoder layer (``feature_layers``), concatenated, projected to one hidden size by
``feature_fc`` and normed (``feature_norm``) before ``fc``. The head's own outputs, which it reads back
along a draft chain, stay in the final-feature space, so a feature is projected exactly when it is wider
than the hidden size.

A reduced draft vocabulary (``draft_vocab``: the ids the draft may propose, e.g. the most frequent
ones in the training data) shrinks the LM-head matmul of every draft step. It cannot cost
correctness: the verifier only needs the draft's true distribution ``q``, which is zero elsewhere.

On disk: ``config.json`` (``EagleConfig``, naming the target it was trained for) and
``model.safetensors`` (the head's weights, plus ``draft_vocab`` when reduced).
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from sluice.core.models.errors import ModelLoadError
from sluice.core.models.layers import ForwardContext, RMSNorm, RotaryEmbedding
from sluice.core.models.llama import LlamaDecoderLayer
from torch import nn

logger = logging.getLogger("sluice")

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
HEADS_DIR = Path(__file__).parent / "heads"
FORMAT = "sluice-eagle1"


class DraftHeadError(ModelLoadError):
    """A draft head cannot be used: missing files, a bad config, or trained for another target."""


@dataclass(slots=True)
class EagleConfig:
    target: str  # the name of the model it was trained for
    hidden_size: int
    vocab_size: int  # the target's
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    final_norm: bool = True
    draft_vocab_size: int = 0  # 0 = the target's whole vocabulary
    # Which target hidden states feed the head: "final" (EAGLE-1), or "eagle3": the outputs of the decoder
    # layers `feature_layers` (ascending, at least two: low / middle / high), concatenated.
    feature: str = "final"
    feature_layers: list[int] = field(default_factory=list)
    format: str = FORMAT
    training: dict = field(default_factory=dict)  # free-form provenance (data, steps, losses)

    @classmethod
    def for_target(cls, target_name: str, target_config, **overrides) -> EagleConfig:
        h = target_config.hidden_size
        heads = target_config.num_attention_heads
        return cls(
            target=target_name,
            hidden_size=h,
            vocab_size=target_config.vocab_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(target_config, "head_dim", None) or h // heads,
            intermediate_size=target_config.intermediate_size,
            rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-5)),
            **overrides,
        )

    @classmethod
    def from_dict(cls, d: dict) -> EagleConfig:
        known = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.name in ("target", "hidden_size", "vocab_size") and f.name not in d]
        if missing:
            raise DraftHeadError(f"draft head config: missing {', '.join(missing)}")
        if d.get("format", FORMAT) != FORMAT:
            raise DraftHeadError(f"draft head config: format {d.get('format')!r} is not {FORMAT!r}")
        return cls(**{k: v for k, v in d.items() if k in known})


class EagleDraftHead(nn.Module):
    def __init__(self, cfg: EagleConfig, target_config, max_position: int) -> None:
        super().__init__()
        if cfg.feature not in ("final", "eagle3"):
            raise DraftHeadError(f"draft head config: feature {cfg.feature!r} is not 'final' or 'eagle3'")
        layers = list(cfg.feature_layers)
        if (cfg.feature == "eagle3") != bool(layers) or len(layers) == 1 or layers != sorted(set(layers)):
            raise DraftHeadError(
                f"draft head config: feature_layers {layers} do not fit feature {cfg.feature!r} "
                "('eagle3' takes two or more ascending layers, 'final' none)"
            )
        self.cfg = cfg
        layer_config = copy.deepcopy(target_config)
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
            setattr(layer_config, name, getattr(cfg, name))
        layer_config.rms_norm_eps = cfg.rms_norm_eps
        h = cfg.hidden_size
        # EAGLE-3 features: projected, then normed (the residual stream's scale grows with depth; the head's
        # own outputs, read back along a chain, are normed features already)
        self.feature_fc = nn.Linear(len(layers) * h, h, bias=False) if layers else None
        self.feature_norm = RMSNorm(h, cfg.rms_norm_eps) if layers else None
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = LlamaDecoderLayer(layer_config, 0, qkv_bias=False)
        self.norm = RMSNorm(h, cfg.rms_norm_eps) if cfg.final_norm else None
        self.rotary = RotaryEmbedding(layer_config, cfg.head_dim, max_position)
        # Full-vocabulary ids of the draft's vocabulary (None: the whole vocabulary).
        self.register_buffer(
            "draft_vocab",
            torch.arange(cfg.draft_vocab_size, dtype=torch.long) if cfg.draft_vocab_size else None,
            persistent=False,
        )

    @property
    def attn(self):
        return self.layer.self_attn

    # The layer's math, split around attention so that training (dense masks) and serving (paged KV)
    # run the same code; it is LlamaDecoderLayer.forward with the attention call left open.
    def fuse(self, token_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        features = features.to(token_embeds.dtype)
        if self.feature_fc is not None and features.shape[-1] != self.cfg.hidden_size:
            features = self.feature_norm(self.feature_fc(features))  # the target's, not the head's own output
        return self.fc(torch.cat([token_embeds, features], dim=-1))

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        a = self.attn
        q, k, v = a.qkv_proj(self.layer.input_layernorm(x)).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        t = x.shape[0]
        q = q.view(t, a.num_heads, a.head_dim)
        k = k.view(t, a.num_kv_heads, a.head_dim)
        v = v.view(t, a.num_kv_heads, a.head_dim)
        q, k = self.rotary(positions, q, k)
        return q, k, v

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The layer after attention: o_proj, residual, MLP, residual, and the optional norm."""
        a = self.attn
        h = a.o_proj(attn_out.reshape(x.shape[0], a.q_size))
        h, residual = self.layer.post_attention_layernorm(h, x)
        out = self.layer.mlp(h) + residual
        return self.norm(out) if self.norm is not None else out

    def forward(
        self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Predicted next features ``[num_tokens, hidden]`` over a flattened batch with paged KV (one layer:
        ``ctx.kv_caches[0]``)."""
        x = self.fuse(token_embeds, features)
        q, k, v = self.qkv(x, positions)
        cache = ctx.kv_caches[0]
        ctx.backend.write_kv(k, v, cache, ctx.attn_metadata.slot_mapping)
        o = ctx.backend.forward(q, cache, ctx.attn_metadata, self.attn.scale)
        return self.finish(x, o)

    def restrict_draft_vocab(self, size: int) -> None:
        """Draft over the vocabulary's first ``size`` ids only (BPE vocabularies number their pieces in merge
        order, the most frequent first), rounded up to a multiple of 64 (whole tiles of the packed CPU kernels),
        where the head drafts over the whole vocabulary and that is smaller; 0, or a head with a vocabulary of its
        own, leaves it as it is."""
        size = -(-size // 64) * 64
        if size and self.draft_vocab is None and size < self.cfg.vocab_size:
            self.draft_vocab = torch.arange(size, dtype=torch.long, device=self.fc.weight.device)

    def lm_weight(self, target_lm_weight: torch.Tensor) -> torch.Tensor:
        """The rows of the target's LM head this draft scores: ``[draft_vocab, hidden]``."""
        return target_lm_weight if self.draft_vocab is None else target_lm_weight[self.draft_vocab]


def eagle3_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers of a target with ``num_layers`` decoder layers (as vLLM picks
    them: 2, n // 2, n - 3), distinct and ascending; two for targets too shallow for three."""
    layers = sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)})
    return layers if len(layers) >= 2 else [0, num_layers - 1]


def target_lm_weight(model) -> torch.Tensor:
    """The target's LM-head matrix ``[vocab, hidden]``: the embedding when tied, also where a CPU model's tied head
    is an int8 copy of it (`core/models/cpu_linear.py`: a module without a dense ``weight``)."""
    tied = model.lm_head is None or model.tie_word_embeddings
    return model.model.embed_tokens.weight if tied else model.lm_head.weight


def new_draft_head(
    target_name: str, target_config, max_position: int, draft_vocab: torch.Tensor | None = None, seed: int = 0, **cfg
) -> EagleDraftHead:
    """A freshly initialised head for ``target_config`` (random, Llama-style init)."""
    overrides = dict(cfg)
    if draft_vocab is not None:
        overrides["draft_vocab_size"] = int(draft_vocab.numel())
    head = EagleDraftHead(EagleConfig.for_target(target_name, target_config, **overrides), target_config, max_position)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 1:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
        if draft_vocab is not None:
            head.draft_vocab = draft_vocab.to(torch.long).clone()
    return head


def save_draft_head(head: EagleDraftHead, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()}
    if head.draft_vocab is not None:
        tensors["draft_vocab"] = head.draft_vocab.detach().cpu().contiguous()
    save_file(tensors, str(out / WEIGHTS_FILE))
    (out / CONFIG_FILE).write_text(json.dumps(asdict(head.cfg), indent=2) + "\n")
    return out


def resolve_draft_head(name: str, target_name: str) -> Path:
    """A head directory: ``name`` itself, or for ``"default"`` the head shipped for ``target_name``."""
    if name == "default":
        path = HEADS_DIR / target_name
        if not (path / CONFIG_FILE).is_file():
            shipped = sorted(p.name for p in HEADS_DIR.glob("*") if (p / CONFIG_FILE).is_file())
            raise DraftHeadError(
                f"speculative_model: no default draft head for model {target_name!r} (shipped: {shipped or 'none'})"
            )
        return path
    path = Path(name).expanduser()
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise DraftHeadError(
            f"speculative_model: {name} is not a draft head directory ({CONFIG_FILE} + {WEIGHTS_FILE})"
        )
    return path


def load_draft_head(
    path: str | Path,
    target_config,
    target_name: str,
    max_position: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> EagleDraftHead:
    """Load a head and check it fits the target (hidden size, vocabulary, attention shape)."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        cfg = EagleConfig.from_dict(json.loads((path / CONFIG_FILE).read_text()))
    except (OSError, json.JSONDecodeError, TypeError) as e:
        raise DraftHeadError(f"draft head {path}: cannot read {CONFIG_FILE}: {e}") from e
    expected = EagleConfig.for_target(target_name, target_config)
    for name in ("hidden_size", "vocab_size"):
        if getattr(cfg, name) != getattr(expected, name):
            raise DraftHeadError(
                f"draft head {path} was trained for {cfg.target!r} ({name}={getattr(cfg, name)}), which does not "
                f"match the target {target_name!r} ({name}={getattr(expected, name)})"
            )
    num_layers = target_config.num_hidden_layers
    if any(not 0 <= i < num_layers for i in cfg.feature_layers):
        raise DraftHeadError(
            f"draft head {path}: feature_layers {cfg.feature_layers} outside the target's {num_layers} layers"
        )
    if cfg.target != target_name:
        logger.warning("draft head %s was trained for %r, serving it with %r", path, cfg.target, target_name)
    head = EagleDraftHead(cfg, target_config, max_position)
    try:
        tensors = load_file(str(path / WEIGHTS_FILE))
    except OSError as e:
        raise DraftHeadError(f"draft head {path}: cannot read {WEIGHTS_FILE}: {e}") from e
    vocab = tensors.pop("draft_vocab", None)
    if cfg.draft_vocab_size:
        if vocab is None or vocab.numel() != cfg.draft_vocab_size:
            raise DraftHeadError(f"draft head {path}: draft_vocab missing or not {cfg.draft_vocab_size} ids")
        if int(vocab.min()) < 0 or int(vocab.max()) >= cfg.vocab_size:
            raise DraftHeadError(f"draft head {path}: draft_vocab ids outside [0, {cfg.vocab_size})")
    try:
        head.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise DraftHeadError(f"draft head {path}: weights do not match its config: {e}") from e
    head.to(device=device)
    for part in (head.feature_fc, head.feature_norm, head.fc, head.layer, head.norm):
        if part is not None:
            part.to(dtype=dtype)
    if vocab is not None:
        head.draft_vocab = vocab.to(device=device, dtype=torch.long)
    return head.eval()
