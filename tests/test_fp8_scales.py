"""The fp8 weight scale rules (`core/models/fp8_scales.py`): the mse search against amax / 448, extreme rows,
row-parallel shards; and the perplexity bench's choice of variants (`app/bench/perplexity.py`)."""

from __future__ import annotations

import json

import pytest
import torch
from sluice.core.models import fp8_scales
from sluice.core.models.fp8_linear import dequantize_weight, quantize_weight
from sluice.core.models.fp8_scales import candidate_errors, max_scales, mse_ratios, weight_scales


def _row_err(w: torch.Tensor, rule: str) -> torch.Tensor:
    q, s = quantize_weight(w, rule)
    return (dequantize_weight(q, s) - w).square().sum(dim=1)


def test_mse_scales_reconstruct_heavy_tailed_rows_no_worse_than_max_and_better_overall():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    w = torch.distributions.StudentT(3.0).sample((64, 512)) * torch.logspace(-4, 1, 64)[:, None]
    w = w + 1e-3 * torch.randn(64, 512, generator=g)
    mse, mx = _row_err(w, "mse"), _row_err(w, "max")
    assert (mse <= mx * (1 + 1e-6)).all()  # r = 1 is a candidate: never worse, row by row
    assert mse.sum() < 0.95 * mx.sum()  # and the search finds better alignments for most rows


def test_mse_scales_stay_within_one_octave_above_max_so_nothing_saturates():
    torch.manual_seed(1)
    w = torch.distributions.Laplace(0.0, 1.0).sample((32, 256))
    q, s = quantize_weight(w, "mse")
    ratio = s / (w.abs().amax(dim=1) / 448)
    assert (ratio >= 1 - 1e-6).all() and (ratio < 2).all()
    assert (ratio > 1.01).any()  # some rows do move
    exact = (w / s[:, None]).abs()
    assert (exact <= 448 * (1 + 1e-6)).all()  # no value clipped


def test_the_chosen_scale_is_the_candidate_of_least_error():
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(3))
    base = max_scales(w.abs().amax(dim=1))
    err = candidate_errors(w, base, mse_ratios())
    s = weight_scales(w, "mse")
    chosen = torch.round((s / base - 1) * fp8_scales.MSE_STEPS).long()
    assert torch.equal(err.gather(1, chosen[:, None])[:, 0], err.min(dim=1).values)


def test_extreme_rows_zero_one_huge_value_and_non_finite():
    w = torch.randn(5, 64, generator=torch.Generator().manual_seed(4)) * 1e-2
    w[0] = 0.0  # all zero: scale 1, zero codes
    w[1, 3] = 1e30  # one huge value among small ones
    w[2] = 0.0
    w[2, 7] = 3.0  # a single value: on a grid point, exactly
    w[3, 5] = float("nan")
    w[4, 1] = float("inf")
    q, s = quantize_weight(w, "mse")
    assert torch.isfinite(s).all() and (s > 0).all() and s[0] == 1.0
    assert not torch.isnan(q.float()).any() and (q[0].float() == 0).all()
    deq = dequantize_weight(q, s)
    assert abs(deq[1, 3] / 1e30 - 1) <= 2**-4 and deq[2, 7] == 3.0 and q[3, 5].float() == 0
    assert torch.isfinite(deq[4, 1]) and deq[4, 1] > 1e38  # +inf saturates at the dtype's largest


def test_row_parallel_shards_pick_the_scale_of_the_whole_row():
    """Two ranks each hold half the columns; with the reduce (max of amax, sum of errors) each picks the whole
    row's scale, without it not always."""
    torch.manual_seed(2)
    w = torch.distributions.StudentT(3.0).sample((48, 256))
    halves = w[:, :128], w[:, 128:]
    whole = weight_scales(w, "mse")

    def reduce_with(other):
        def reduce(t, op):
            if op == "max":
                t.copy_(torch.maximum(t, other.abs().amax(dim=1)))
            else:
                t.add_(candidate_errors(other, max_scales(w.abs().amax(dim=1)), mse_ratios()))

        return reduce

    for mine, other in (halves, halves[::-1]):
        assert torch.equal(weight_scales(mine, "mse", reduce_with(other)), whole)
    assert not torch.equal(weight_scales(halves[0], "mse"), whole)


def test_bad_rules_are_refused():
    from sluice.core.models.fp8_recipe import Fp8Recipe

    with pytest.raises(ValueError, match="weight scale rule"):
        weight_scales(torch.ones(2, 4), "absmax")
    with pytest.raises(ValueError, match="weight scale rule"):
        Fp8Recipe("absmax")
    with pytest.raises(ValueError, match="dense_last_layers"):
        Fp8Recipe(dense_last_layers=-1)


# ---------------------------------------------------------------------------------- the perplexity bench


def test_variant_names_put_base_first_once_and_refuse_unknown_ones():
    from sluice.app.bench.perplexity import variant_names

    assert variant_names("fp8") == ["base", "fp8"]
    assert variant_names("fp8,base,fp8-all,fp8") == ["base", "fp8", "fp8-all"]
    with pytest.raises(ValueError, match="unknown"):
        variant_names("fp8,fp9")
    with pytest.raises(ValueError):
        variant_names(" , ")


def test_bench_runs_fp8_recipes_side_by_side_and_the_default_last(tmp_path):
    from sluice.app.commands.cli import main
    from sluice.core.models.fp8_recipe import Fp8Recipe, recipe

    out = tmp_path / "ppl.json"
    argv = ["bench", "perplexity", "--model", "dummy:tiny", "--device", "cpu", "--num-tokens", "64", "--seq-len", "64"]
    main([*argv, "--variants", "fp8-mse-all,fp8-all,fp8", "--out", str(out)])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["variants"]}
    assert list(rows) == ["base", "fp8-mse-all", "fp8-all", "fp8"]
    assert rows["base"]["fp8_layers"] is None
    assert rows["fp8-mse-all"]["fp8_layers"] == {"weight_scale": "mse", "fp8_linear": 8, "dense_linear": 0}
    assert rows["fp8-all"]["fp8_layers"] == {"weight_scale": "max", "fp8_linear": 8, "dense_linear": 0}
    default = Fp8Recipe()  # fp8 is the process's recipe
    dense = 4 * default.dense_last_layers
    assert rows["fp8"]["fp8_layers"] == {
        "weight_scale": default.weight_scale,
        "fp8_linear": 8 - dense,
        "dense_linear": dense,
    }
    assert (rows["fp8"]["weights_gib"] > rows["fp8-all"]["weights_gib"]) == (dense > 0)
    assert rows["fp8"]["bound_pct"] == 1.5 and rows["fp8-mse-all"]["bound_pct"] is None
    assert recipe() == default  # each variant's recipe held only while it loaded
