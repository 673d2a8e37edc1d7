"""The mixture-of-experts MLP: a router picks ``top_k`` of ``E`` experts per token, each expert is a SiLU-gated MLP,
and the token's output is the routing-weighted sum of its experts' outputs.

Experts are stored stacked, one tensor per projection for all experts of a layer: ``gate_up_proj`` ``[E, 2 * I, H]``
(each expert's gate rows then its up rows) and ``down_proj`` ``[E, H, I]``, the layout transformers 5 keeps in memory
and the one the grouped GEMM of `core/models/fused_moe.py` reads. Checkpoints hold experts either that way (fused
names) or one tensor per expert and projection (what ``save_pretrained`` writes, and older or converted checkpoints):
`ExpertWeights` loads both into the stacked parameters.

Routing (`fused_moe.route`) as transformers defines it for both families: softmax over all experts' logits
(fp32), the ``top_k`` largest, and with ``renormalize`` those divided by their sum. Mixtral always renormalizes
(which equals a softmax over the top-k logits); Qwen3-MoE does when ``norm_topk_prob``.

Tensor parallel: every rank holds every expert, cut along the intermediate dim (gate/up rows, down columns), so
each rank's experts give a partial sum that one all-reduce completes, as the dense MLP's do. The router is
replicated. A GPU runs the Triton kernels, the CPU the torch loop (`fused_moe.moe_forward`); with the decode path
enabled (`enable_decode_kernels`: by default for many small experts, `decode_preferred`; ``SLUICE_MOE_DECODE=1``
for every layer, ``0`` for none), a call of a few tokens takes `core/models/moe_decode.py`, router included.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from sluice.core.models.errors import ModelLoadError
from sluice.core.models.parallel import TensorParallel, shard_range
from torch import nn


class Router(nn.Module):
    """The gate: one logit per expert. Not a `Linear`, so that quantization and the GEMV leave routing alone."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Experts(nn.Module):
    """Every expert of a layer, stacked (this rank's part of the intermediate dim under tensor parallel)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        # the Triton kernels (True), the torch loop (False) or by device (None: Triton on a GPU)
        self.use_triton: bool | None = None
        # the few-token path's arrival counters (`enable_decode_kernels`; None: that path is off)
        self.decode_counters: torch.Tensor | None = None

    def enable_decode_kernels(self, top_k: int) -> None:
        """Calls of a few tokens (`moe_decode.fits`) take `moe_decode.decode_moe` on the Triton path."""
        from sluice.core.models import moe_decode

        e, _, h = self.gate_up_proj.shape
        n = moe_decode.counters_needed(top_k, e, h)
        self.decode_counters = torch.zeros(n, dtype=torch.int32, device=self.gate_up_proj.device)

    def forward(self, x: torch.Tensor, router: Router, top_k: int, renormalize: bool) -> torch.Tensor:
        from sluice.core.models import moe_decode
        from sluice.core.models.fused_moe import moe_forward

        triton = x.is_cuda if self.use_triton is None else self.use_triton
        w13, w2 = self.gate_up_proj, self.down_proj
        num_experts, _, intermediate = w2.shape
        decode = self.decode_counters is not None and moe_decode.fits(x.shape[0], top_k, num_experts, intermediate)
        if triton and decode:
            return moe_decode.decode_moe(x, router.weight, w13, w2, top_k, renormalize, self.decode_counters)
        return moe_forward(x, router(x), w13, w2, top_k, renormalize, triton)


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP as routed experts (the `LlamaDecoderLayer` MLP interface: ``forward_normed``)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = top_k
        self.renormalize = renormalize
        self.intermediate_size = intermediate_size  # the checkpoint's (whole) size
        local = intermediate_size
        if tp is not None:
            start, end = shard_range(intermediate_size, tp.rank, tp.world_size)
            local = end - start
        self.gate = Router(hidden_size, num_experts)
        self.experts = Experts(num_experts, hidden_size, local)

    def enable_decode_kernels(self) -> None:
        self.experts.enable_decode_kernels(self.top_k)

    def decode_preferred(self) -> bool:
        """Whether this layer's experts take the few-token path by default (`moe_decode.preferred`)."""
        from sluice.core.models import moe_decode

        return moe_decode.preferred(self.experts.gate_up_proj.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate, self.top_k, self.renormalize)
        return out if self.tp is None else self.tp.all_reduce(out)

    def forward_normed(self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None):
        """``(moe(norm(x + residual)), x + residual)``: the MLP half of a decoder layer."""
        h, residual = (norm(x), x) if residual is None else norm(x, residual)
        return self(h), residual


# A per-expert checkpoint tensor: ``<layer>.<mlp|block_sparse_moe>.experts.<e>.<proj>.weight``, and the fused form
# ``<layer>.<mlp|block_sparse_moe>.experts.<gate_up_proj|down_proj>``.
_PER_EXPERT = re.compile(r"^(?P<layer>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
_FUSED = re.compile(r"^(?P<layer>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<proj>gate_up_proj|down_proj)$")
# per-expert projection -> (stacked parameter, part): 0 gate rows, 1 up rows, -1 the whole down projection.
# Qwen3-MoE (and transformers' per-expert form) names gate/up/down_proj; Mixtral w1 (gate), w3 (up), w2 (down).
EXPERT_PROJ = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", -1),
    "w1": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", -1),
}


class ExpertWeights:
    """Loads a model's expert tensors into its stacked parameters, per expert or fused, and says which are missing.

    `take` passes every other checkpoint tensor on (Mixtral's ``block_sparse_moe`` renamed ``mlp``, where this
    model's router lives), for the model's own loader, which leaves the stacked parameters (`params`) to this."""

    def __init__(self, model: nn.Module) -> None:
        self.blocks = {n: m for n, m in model.named_modules() if isinstance(m, SparseMoeBlock)}
        self.params = {f"{n}.experts.{p}" for n in self.blocks for p in ("gate_up_proj", "down_proj")}
        # (block, stacked parameter, expert, part) still to be filled
        self.pending = {
            (n, p, e, part)
            for n, b in self.blocks.items()
            for e in range(b.experts.gate_up_proj.shape[0])
            for p, part in (("gate_up_proj", 0), ("gate_up_proj", 1), ("down_proj", -1))
        }

    def take(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if m := _PER_EXPERT.match(name):
                if m["proj"] not in EXPERT_PROJ:
                    yield name, tensor  # not an expert projection: the model's loader calls it unexpected
                    continue
                param, part = EXPERT_PROJ[m["proj"]]
                self._copy(name, f"{m['layer']}.mlp", param, int(m["e"]), part, tensor)
            elif m := _FUSED.match(name):
                self._copy_fused(name, f"{m['layer']}.mlp", m["proj"], tensor)
            else:
                yield name.replace(".block_sparse_moe.", ".mlp."), tensor

    def _copy_fused(self, name: str, block: str, param: str, tensor: torch.Tensor) -> None:
        if param == "down_proj":
            for e in range(tensor.shape[0]):
                self._copy(name, block, param, e, -1, tensor[e])
            return
        half = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            self._copy(name, block, param, e, 0, tensor[e, :half])
            self._copy(name, block, param, e, 1, tensor[e, half:])

    def _copy(self, name: str, block: str, param: str, expert: int, part: int, tensor: torch.Tensor) -> None:
        """Expert ``expert``'s ``part`` of ``param`` from its whole checkpoint tensor (this rank's cut of it)."""
        moe = self.blocks.get(block)
        if moe is None or expert >= moe.experts.gate_up_proj.shape[0]:
            raise ModelLoadError(f"unexpected weights in checkpoint: {name}")
        dst = getattr(moe.experts, param)[expert]
        local = dst.shape[0] // 2 if part >= 0 else dst.shape[1]
        dim = 0 if part >= 0 else 1  # gate/up: rows of the intermediate dim; down: its columns
        if moe.tp is not None:
            start, end = shard_range(moe.intermediate_size, moe.tp.rank, moe.tp.world_size)
            tensor = tensor.narrow(dim, start, end - start) if tensor.shape[dim] == moe.intermediate_size else tensor
        if part >= 0:
            dst = dst.narrow(0, part * local, local)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"weight {name}: shape {tuple(tensor.shape)} != expected {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(tensor)
        self.pending.discard((block, param, expert, part))

    def check_complete(self) -> None:
        """Every expert's gate, up and down projection was loaded; else the missing ones, by per-expert name."""
        if self.pending:
            proj = {0: "gate_proj", 1: "up_proj", -1: "down_proj"}
            names = sorted(f"{b}.experts.{e}.{proj[part]}" for b, _, e, part in self.pending)
            raise ModelLoadError(f"missing weights in checkpoint: {', '.join(names[:8])}")


class MoEWeightsLoading:
    """A mixin for a `LlamaForCausalLM` family with `SparseMoeBlock` MLPs: experts through `ExpertWeights`, the rest
    through the family's own loader, with both checks (nothing unexpected, nothing missing) kept."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        experts = ExpertWeights(self)
        super().load_weights(experts.take(weights), filled_elsewhere=experts.params)
        experts.check_complete()
