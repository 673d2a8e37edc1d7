"""Qwen3-MoE: Qwen3's attention (per-head q/k norms, `core/models/qwen3.py`) with routed experts as the MLP of its
sparse layers (`core/models/moe.py`).

Which layers are sparse is the config's: every ``decoder_sparse_step``-th layer (``(i + 1) % step == 0``) unless
listed in ``mlp_only_layers``, and none without experts; the others keep a dense MLP of ``intermediate_size``,
while each expert has ``moe_intermediate_size``. Routing: softmax, top ``num_experts_per_tok``, renormalized when
``norm_topk_prob``. Qwen3-MoE configs have no shared expert (Qwen2-MoE's ``shared_expert_*`` fields); one that names
them is refused rather than served without it.
"""

from __future__ import annotations

from sluice.core.models.errors import ModelLoadError
from sluice.core.models.llama import LlamaDecoderLayer
from sluice.core.models.moe import MoEWeightsLoading, SparseMoeBlock
from sluice.core.models.parallel import TensorParallel
from sluice.core.models.qwen3 import Qwen3ForCausalLM
from torch import nn


def is_sparse_layer(config, layer_idx: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    only_mlp = getattr(config, "mlp_only_layers", None) or []
    return config.num_experts > 0 and layer_idx not in only_mlp and (layer_idx + 1) % step == 0


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, config, layer_idx: int, tp: TensorParallel | None) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return super().build_mlp(config, layer_idx, tp)
        return SparseMoeBlock(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            renormalize=bool(config.norm_topk_prob),
            tp=tp,
        )


class Qwen3MoeForCausalLM(MoEWeightsLoading, Qwen3ForCausalLM):
    decoder_layer_cls = Qwen3MoeDecoderLayer

    def __init__(self, config, max_position: int, tp: TensorParallel | None = None) -> None:
        if getattr(config, "shared_expert_intermediate_size", 0):
            raise ModelLoadError("a shared expert (shared_expert_intermediate_size) is not supported for Qwen3-MoE")
        super().__init__(config, max_position, tp)
