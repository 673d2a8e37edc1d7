"""Mixtral: the Llama layers (Mistral's attention is Llama's, GQA, ``head_dim`` from the config when it names one)
with every MLP a mixture of ``num_local_experts`` experts, ``num_experts_per_tok`` (2) per token, their routing
weights renormalized over the chosen ones (`core/models/moe.py`).

Checkpoints name the MLP ``block_sparse_moe`` and the expert projections ``w1`` (gate), ``w3`` (up), ``w2`` (down);
the loader maps them onto ``mlp`` and the stacked expert weights. A sliding window (Mistral's ``sliding_window``)
shorter than the longest sequence served is refused: Mixtral-8x7B's is null, and the attention kernels here attend
to the whole context.
"""

from __future__ import annotations

from sluice.core.models.errors import ModelLoadError
from sluice.core.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from sluice.core.models.moe import MoEWeightsLoading, SparseMoeBlock
from sluice.core.models.parallel import TensorParallel


class MixtralDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, config, layer_idx: int, tp: TensorParallel | None) -> SparseMoeBlock:
        return SparseMoeBlock(
            config.hidden_size,
            config.intermediate_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            renormalize=True,
            tp=tp,
        )


class MixtralForCausalLM(MoEWeightsLoading, LlamaForCausalLM):
    decoder_layer_cls = MixtralDecoderLayer

    def __init__(self, config, max_position: int, tp: TensorParallel | None = None) -> None:
        window = getattr(config, "sliding_window", None)
        if window is not None and window < max_position:
            raise ModelLoadError(
                f"Mixtral with a sliding window ({window} < {max_position} positions) is not supported"
            )
        super().__init__(config, max_position, tp)
