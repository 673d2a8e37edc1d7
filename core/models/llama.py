"""The Llama family (Llama 2/3, SmolLM2, TinyLlama; Qwen2 = Llama + qkv bias) on a flattened batch; other
families build on its layers (`core/models/qwen3.py`).

Checkpoint names map onto merged projections: ``q/k/v_proj`` -> ``qkv_proj`` and ``gate/up_proj`` ->
``gate_up_proj``, one matmul each instead of three and two.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import torch
from sluice.core.models.errors import ModelLoadError
from sluice.core.models.layers import (
    ForwardContext,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    linear_then_act,
    norm_then_linear,
    sliding_window_of,
)
from sluice.core.models.parallel import TensorParallel, VocabParallelEmbedding, plan_heads, shard_range, take_heads
from sluice.kv.attention.base import DecodeRope
from torch import nn

# checkpoint suffix -> (our suffix, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _checkpoint_name(param: str, shard: int) -> str:
    """The checkpoint tensor behind ``(param, shard)``: a shard of a merged projection by its own name."""
    if shard < 0:
        return param
    prefix, merged, suffix = param.rsplit(".", 2)
    ckpt = next(old for old, (new, idx) in _STACKED.items() if new == merged and idx == shard)
    return f"{prefix}.{ckpt}.{suffix}"


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, qkv_bias: bool, tp: TensorParallel | None = None) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or h // self.num_heads
        # tensor parallel: this rank's heads (`plan_heads`); every size below is then the local one
        self.tp = tp
        self.heads = plan_heads(self.num_heads, self.num_kv_heads, tp.rank, tp.world_size) if tp else None
        if self.heads is not None:
            self.num_heads, self.num_kv_heads = len(self.heads.q_heads), len(self.heads.kv_heads)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.layer_idx = layer_idx
        self.scale = self.head_dim**-0.5
        # the keys a query sees (0: all; Mistral, Gemma, Phi-3) and the logit soft-cap (0: none; Gemma 2)
        self.sliding_window = sliding_window_of(config, layer_idx)
        self.softcap = float(getattr(config, "attn_logit_softcapping", None) or 0.0)
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, h, bias=False)
        # shard sizes along dim 0 of qkv_proj, in _STACKED order
        self.shard_sizes = (self.q_size, self.kv_size, self.kv_size)
        # fp8 KV cache: per-head scales [2, num_kv_heads], set once before the first write
        self.kv_scale: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, ctx: ForwardContext):
        return self.forward_qkv(self.qkv_proj(x), positions, rotary, ctx)

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, Hq, D]``, k and v ``[T, Hk, D]`` of the qkv projection's output, before RoPE: the hook a
        family overrides to transform q and k first (Qwen3's per-head norms), so every RoPE path sees its keys."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = qkv.shape[0]
        return (
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
        )

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, ctx: ForwardContext):
        """The layer from its qkv projection on (which the decoder layer may compute with the norm before it)."""
        q, k, v = self.split_heads(qkv)
        t = qkv.shape[0]
        kv_cache = ctx.kv_caches[self.layer_idx]
        meta = ctx.attn_metadata
        rope = None
        if rotary.fused_write is not None and self.kv_scale is None and kv_cache.dtype == k.dtype:
            if ctx.backend.takes_rope(meta):  # the attention kernel rotates q and k and stores k and v itself
                rope = DecodeRope(positions, k, v, rotary.cos, rotary.sin, meta.slot_mapping)
            else:  # one kernel rotates q and k and stores k and v in the cache (its layout is every backend's)
                rotary.fused_write(positions, q, k, v, rotary.cos, rotary.sin, kv_cache, meta.slot_mapping)
        else:
            q, k = rotary(positions, q, k)
            ctx.backend.write_kv(k, v, kv_cache, meta.slot_mapping, self.kv_scale)
        o = ctx.backend.forward(q, kv_cache, meta, self.scale, self.kv_scale, rope, self.sliding_window, self.softcap)
        out = self.o_proj(o.reshape(t, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaMLP(nn.Module):
    def __init__(self, config, tp: TensorParallel | None = None) -> None:
        super().__init__()
        h, m = config.hidden_size, config.intermediate_size
        self.tp = tp
        if tp is not None:
            start, end = shard_range(m, tp.rank, tp.world_size)
            m = end - start
        self.gate_up_proj = Linear(h, 2 * m, bias=False)
        self.down_proj = Linear(m, h, bias=False)
        self.act = SiluAndMul()
        self.shard_sizes = (m, m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_act(linear_then_act(self.gate_up_proj, self.act, x))  # one kernel for few rows

    def forward_act(self, a: torch.Tensor) -> torch.Tensor:
        """The MLP from its SiLU-and-mul's output on (the decoder layer computes that with the norm before it)."""
        out = self.down_proj(a)
        return out if self.tp is None else self.tp.all_reduce(out)

    def forward_normed(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None):
        """``(mlp(norm(x + residual)), x + residual)``, the MLP half of a decoder layer: what every MLP a decoder
        layer builds has (`core/models/moe.py`'s too). Here each norm with the projection after it, one kernel for
        few rows (`norm_then_linear`)."""
        a, residual = norm_then_linear(norm, self.gate_up_proj, x, residual, self.act)
        return self.forward_act(a), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer_idx: int,
        qkv_bias: bool,
        tp: TensorParallel | None = None,
        attention_cls: type[LlamaAttention] = LlamaAttention,
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_idx, qkv_bias, tp)
        self.mlp = self.build_mlp(config, layer_idx, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def build_mlp(self, config, layer_idx: int, tp: TensorParallel | None) -> nn.Module:
        """This layer's MLP (with `LlamaMLP.forward_normed`): the hook a family whose layers have other MLPs
        overrides (mixture-of-experts layers, `core/models/moe.py`)."""
        return LlamaMLP(config, tp)

    def forward(self, x, residual, positions, rotary, ctx):
        # each norm with the projection after it: one kernel for few rows (`norm_then_linear`)
        qkv, residual = norm_then_linear(self.input_layernorm, self.self_attn.qkv_proj, x, residual)
        h = self.self_attn.forward_qkv(qkv, positions, rotary, ctx)
        return self.mlp.forward_normed(self.post_attention_layernorm, h, residual)


class LlamaModel(nn.Module):
    def __init__(
        self,
        config,
        qkv_bias: bool,
        tp: TensorParallel | None = None,
        attention_cls: type[LlamaAttention] = LlamaAttention,
        layer_cls: type[nn.Module] = LlamaDecoderLayer,
    ) -> None:
        super().__init__()
        if tp is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            layer_cls(config, i, qkv_bias, tp, attention_cls) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The Llama family; another family is a subclass that sets what differs (class attributes, a hook)."""

    qkv_bias = False
    attention_cls: type[LlamaAttention] = LlamaAttention
    decoder_layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, config, max_position: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        qkv_bias = self.qkv_bias or bool(getattr(config, "attention_bias", False))
        self.model = LlamaModel(config, qkv_bias, tp, self.attention_cls, self.decoder_layer_cls)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # tensor parallel: the vocabulary rows of each rank (embedding and LM head alike)
        vocab = config.vocab_size
        self.vocab_ranges = None
        if tp is not None:
            self.vocab_ranges = [shard_range(vocab, r, tp.world_size) for r in range(tp.world_size)]
            vocab = self.vocab_ranges[tp.rank][1] - self.vocab_ranges[tp.rank][0]
        self.lm_head = None if self.tie_word_embeddings else Linear(config.hidden_size, vocab, bias=False)
        head_dim = self.model.layers[0].self_attn.head_dim
        self.rotary = RotaryEmbedding(config, head_dim, max_position)

    @property
    def num_kv_heads(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.model.layers[0].self_attn.head_dim

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, aux_layers: Sequence[int] = ()
    ):
        """Final (normed) hidden states ``[num_tokens, hidden]`` of a flattened batch. With ``aux_layers``
        (ascending decoder-layer indices), also the hidden states after those layers (the residual stream,
        what Hugging Face's ``hidden_states[i + 1]`` holds), concatenated: ``(final, [num_tokens, n * hidden])``,
        the features of an EAGLE-3 style draft head."""
        x = self.model.embed_tokens(input_ids)
        residual = None
        aux = []
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, positions, self.rotary, ctx)
            if i in aux_layers:
                aux.append(x + residual)  # a new tensor: the next layer's fused norm updates residual in place
        x, _ = self.model.norm(x, residual)
        return (x, torch.cat(aux, dim=-1)) if aux_layers else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            logits = hidden @ self.model.embed_tokens.weight.t()
        else:
            logits = self.lm_head(hidden)  # a module call: the head may be a quantized linear
        if self.tp is None:
            return logits
        return self.tp.gather_last_dim(logits, [e - s for s, e in self.vocab_ranges])

    def _tp_shard(self, target: str, shard: int, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor bound for parameter ``target`` (``shard`` of it when merged)."""
        tp = self.tp
        module = target.rpartition(".")[0]
        name = module.rpartition(".")[2]
        if name in ("embed_tokens", "lm_head"):
            start, end = self.vocab_ranges[tp.rank]
            return tensor.narrow(0, start, end - start)
        if name in ("qkv_proj", "o_proj"):
            attn = self.get_submodule(module.rpartition(".")[0])
            if name == "o_proj":  # input columns of this rank's query heads
                return take_heads(tensor, attn.heads.q_heads, attn.head_dim, 1)
            return take_heads(tensor, attn.heads.q_heads if shard == 0 else attn.heads.kv_heads, attn.head_dim, 0)
        if name in ("gate_up_proj", "down_proj"):  # gate/up: output rows; down: input columns
            dim = 0 if name == "gate_up_proj" else 1
            start, end = shard_range(tensor.shape[dim], tp.rank, tp.world_size)
            return tensor.narrow(dim, start, end - start)
        return tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], filled_elsewhere: Collection[str] = ()) -> None:
        """Copy checkpoint tensors into the merged parameters; fail on anything missing or unexpected.
        ``filled_elsewhere``: parameters another loader fills (stacked experts, `core/models/moe.py`)."""
        params = {n: p for n, p in self.named_parameters() if n not in filled_elsewhere}
        # (param name, shard) pairs still to be filled
        pending: set[tuple[str, int]] = set()
        for name, _p in params.items():
            if name.endswith(("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight")):
                shards = self.get_submodule(name.rsplit(".", 2)[0]).shard_sizes
                pending.update((name, i) for i in range(len(shards)))
            else:
                pending.add((name, -1))
        unexpected: list[str] = []
        for ckpt_name, tensor in weights:
            if "rotary_emb.inv_freq" in ckpt_name:
                continue
            if ckpt_name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            target, shard = ckpt_name, -1
            for old, (new, idx) in _STACKED.items():
                if f".{old}." in ckpt_name:
                    target, shard = ckpt_name.replace(f".{old}.", f".{new}."), idx
                    break
            param = params.get(target)
            if param is None:
                unexpected.append(ckpt_name)
                continue
            if self.tp is not None:
                tensor = self._tp_shard(target, shard, tensor)
            with torch.no_grad():
                if shard < 0:
                    if tuple(param.shape) != tuple(tensor.shape):
                        raise ModelLoadError(
                            f"weight {ckpt_name}: shape {tuple(tensor.shape)} != expected {tuple(param.shape)}"
                        )
                    param.copy_(tensor)
                else:
                    owner = self.get_submodule(target.rsplit(".", 2)[0])
                    sizes = owner.shard_sizes
                    start = sum(sizes[:shard])
                    dst = param.narrow(0, start, sizes[shard])
                    if tuple(dst.shape) != tuple(tensor.shape):
                        raise ModelLoadError(
                            f"weight {ckpt_name}: shape {tuple(tensor.shape)} != expected {tuple(dst.shape)}"
                        )
                    dst.copy_(tensor)
            pending.discard((target, shard))
        if unexpected:
            raise ModelLoadError(f"unexpected weights in checkpoint: {', '.join(sorted(unexpected)[:8])}")
        if pending:
            missing = sorted({_checkpoint_name(n, shard) for n, shard in pending})
            raise ModelLoadError(f"missing weights in checkpoint: {', '.join(missing[:8])}")


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
