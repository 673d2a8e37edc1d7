"""`TargetForward`: the target model's forward over its KV pool, what a speculative step and the graphs that
capture one run: the final hidden states (for the LM head) and the draft head's features beside them."""

from __future__ import annotations

import torch
from sluice.core.models.layers import ForwardContext


class TargetForward:
    def __init__(self, model, kv_caches: list[torch.Tensor], backend, feature_layers: tuple[int, ...]) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.feature_layers = feature_layers  # () = the final hidden state is the features (EAGLE-1)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = ForwardContext(meta, self.kv_caches, self.backend)
        if not self.feature_layers:
            hidden = self.model(input_ids, positions, ctx)
            return hidden, hidden
        return self.model(input_ids, positions, ctx, aux_layers=self.feature_layers)
