"""What ``--quantization fp8`` makes fp8 at load, and with which weight scales: the recipe.

``weight_scale``: how each weight row's scale is chosen (`fp8_scales`): ``max`` (amax / 448) by default. ``mse``
lowers each row's reconstruction error (12-18% on the default model) and the model's KL divergence from the
unquantized one a little, yet measured worse perplexity on the held-out text (+2.34% against +2.22% with every
layer fp8, +2.46% against +1.26% with the last layer dense: `docs/benchmarks/fp8/`), so it is a switch
(``SLUICE_FP8_WEIGHT_SCALE=mse``), not the default.

``dense_last_layers``: the last decoder layers that stay in the model's dtype (1 by default). The last layer's
output reaches the logits through nothing but the final norm and the LM head (dense too, `fp8_linear`'s module
doc), so its rounding error has no later layer to average it out; on the default model its MLP alone makes about
a fifth of the whole model's fp8 divergence from the unquantized one (`scripts/fp8_sensitivity.py --study ends`),
the first layer a twentieth, any other a few hundredths; kept dense, the held-out perplexity goes from +2.22% to
+1.26% over the unquantized model. A rule of position, not a list of names for one model: it costs the last
layer's linear weights at 16 bits instead of 8, 1/L of the decoder's linear bytes more for L layers (SmolLM2-135M:
3.5 MB; Llama-3.1-8B: 218 MB, ~2.7% of an fp8 decode step's weight bytes).

``lm_head``: the LM head in fp8 too (off by default: `fp8_linear`'s module doc says why it stays dense). It is
~6% of Llama-3-8B's bf16 bytes and half of that in fp8, so a batch-1 step reads ~3% fewer bytes with it; a model
whose head is tied to its embedding keeps the table for lookups beside the head's fp8 copy. Never with a draft head
(speculation reads the target's head weight). Its cost in perplexity on the default model: docs/benchmarks.md.

The process keeps one recipe (`configure`, from `core/envs.py`'s ``SLUICE_FP8_*`` at start-up); a benchmark puts
another in force while it loads one model (`recipe_as`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from sluice.core.models.fp8_scales import check_rule

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class Fp8Recipe:
    weight_scale: str = "max"
    dense_last_layers: int = 1
    lm_head: bool = False

    def __post_init__(self) -> None:
        check_rule(self.weight_scale)
        if self.dense_last_layers < 0:
            raise ValueError(f"fp8 dense_last_layers must be >= 0, got {self.dense_last_layers}")

    def fp8_targets(self, names: list[str]) -> list[str]:
        """Of linear layers ``names``, those to make fp8: all but the last ``dense_last_layers`` decoder layers'
        (a name's layer is its ``layers.<i>.`` index; names outside the decoder layers are kept)."""
        index = {n: int(m.group(1)) for n in names if (m := _LAYER.search(n))}
        if not index or self.dense_last_layers == 0:
            return names
        first_dense = max(index.values()) + 1 - self.dense_last_layers
        return [n for n in names if index.get(n, -1) < first_dense]


_recipe = Fp8Recipe()


def recipe() -> Fp8Recipe:
    return _recipe


def configure(
    weight_scale: str | None = None, dense_last_layers: int | None = None, lm_head: bool | None = None
) -> None:
    """Change the process's recipe (``None``: that part as it is)."""
    global _recipe
    changes = {"weight_scale": weight_scale, "dense_last_layers": dense_last_layers, "lm_head": lm_head}
    _recipe = replace(_recipe, **{k: v for k, v in changes.items() if v is not None})


@contextmanager
def recipe_as(r: Fp8Recipe) -> Iterator[None]:
    """`recipe` is ``r`` inside the block, what it was after it."""
    global _recipe
    before, _recipe = _recipe, r
    try:
        yield
    finally:
        _recipe = before
