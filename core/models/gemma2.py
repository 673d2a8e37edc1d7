"""Gemma 2: the Llama attention and MLP in a layer with a norm before and after each of them, and what the
configuration says differs:

* every norm is ``(1 + w) * rmsnorm(x)`` computed in fp32 and rounded once (`GemmaRMSNorm`);
* the MLP's activation is GELU with the tanh approximation (``hidden_activation``), not SiLU;
* token embeddings are multiplied by ``sqrt(hidden_size)``, rounded to the model's dtype first, as transformers;
* attention scales by ``query_pre_attn_scalar ** -0.5`` and soft-caps its logits (``attn_logit_softcapping``),
  the final logits are soft-capped too (``final_logit_softcapping``);
* sliding-window layers alternate with global ones (``layer_types``): the attention layer reads its own window
  (`layers.sliding_window_of`) and hands it to the backend with the soft-cap, per call, so both kernels serve
  every layer without recompiling.

Checkpoint names are Llama's plus ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm``; the norms
keep the fused kernels off (theirs computes ``w * x``), the projections keep theirs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from sluice.core.models.layers import ForwardContext, RMSNorm
from sluice.core.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from sluice.core.models.parallel import TensorParallel
from torch import nn


class GemmaRMSNorm(RMSNorm):
    """``(1 + w) * x / rms(x)`` in fp32, rounded once to the input's dtype (transformers' Gemma norms)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (h * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(gate) * up`` of the merged gate/up projection's output."""

    fused = None  # no fused kernel: `linear_then_act` keeps the projection and this apart

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class GemmaAttention(LlamaAttention):
    def __init__(self, config, layer_idx: int, qkv_bias: bool, tp: TensorParallel | None = None) -> None:
        super().__init__(config, layer_idx, qkv_bias, tp)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5


class GemmaDecoderLayer(nn.Module):
    """Norms before and after attention and MLP; the stream's sum runs in the next norm (``norm(x, residual)``)."""

    def __init__(self, config, layer_idx: int, qkv_bias: bool, tp, attention_cls: type[LlamaAttention]) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_idx, qkv_bias, tp)
        self.mlp = LlamaMLP(config, tp)
        self.mlp.act = GeluTanhAndMul()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x, residual, positions, rotary, ctx):
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, positions, rotary, ctx))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    attention_cls = GemmaAttention
    decoder_layer_cls = GemmaDecoderLayer

    def __init__(self, config, max_position: int, tp: TensorParallel | None = None) -> None:
        super().__init__(config, max_position, tp)
        self.model.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # sqrt(hidden) in the model's dtype once `to(dtype)` runs, as transformers rounds it
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.final_softcap = float(getattr(config, "final_logit_softcapping", None) or 0.0)
        self.layer_rotary = [self.rotary] * len(self.model.layers)  # the RoPE table of each layer (Gemma 3 has two)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        return x * self.embed_scale.to(x.dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, aux_layers: Sequence[int] = ()
    ):
        """As `LlamaForCausalLM.forward`, over scaled embeddings and with each layer's RoPE table."""
        x = self.embed(input_ids)
        residual = None
        aux = []
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, positions, self.layer_rotary[i], ctx)
            if i in aux_layers:
                aux.append(x + residual)
        x, _ = self.model.norm(x, residual)
        return (x, torch.cat(aux, dim=-1)) if aux_layers else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap:
            logits = self.final_softcap * torch.tanh(logits / self.final_softcap)
        return logits
