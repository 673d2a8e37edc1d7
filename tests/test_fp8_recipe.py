"""What ``--quantization fp8`` makes fp8 (`core/models/fp8_recipe.py`): the last decoder layers kept dense by
position, the weight scale rule; the process recipe from the environment."""

from __future__ import annotations

import torch
from sluice.core.models import fp8_recipe
from sluice.core.models.fp8_linear import Fp8Linear, quantize_model_fp8
from sluice.core.models.fp8_recipe import Fp8Recipe
from torch import nn

NAMES = [f"model.layers.{i}.{p}" for i in range(3) for p in ("self_attn.qkv_proj", "mlp.down_proj")] + ["mtp.proj"]


def test_the_last_decoder_layers_stay_dense_by_position():
    assert Fp8Recipe(dense_last_layers=1).fp8_targets(NAMES) == NAMES[:4] + ["mtp.proj"]  # layer 2's stay dense
    assert Fp8Recipe(dense_last_layers=2).fp8_targets(NAMES) == NAMES[:2] + ["mtp.proj"]
    assert Fp8Recipe(dense_last_layers=0).fp8_targets(NAMES) == NAMES
    assert Fp8Recipe(dense_last_layers=1).fp8_targets(["a.proj", "b.proj"]) == ["a.proj", "b.proj"]  # no layers


def _model(layers: int = 3) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList(nn.ModuleDict({"proj": nn.Linear(32, 16)}) for _ in range(layers))
    model.lm_head = nn.Linear(16, 8)
    return model


def test_quantize_model_keeps_the_recipes_dense_layers_as_they_were():
    model = _model()
    last = model.model.layers[2]["proj"]
    counts = quantize_model_fp8(model, recipe=Fp8Recipe("mse", dense_last_layers=1))
    assert counts == {"fp8": 2, "dense": 1}
    assert [type(m["proj"]) for m in model.model.layers] == [Fp8Linear, Fp8Linear, nn.Linear]
    assert model.model.layers[2]["proj"] is last and type(model.lm_head) is nn.Linear
    assert {m["proj"].weight_scale_rule for m in model.model.layers[:2]} == {"mse"}


def test_the_process_recipe_comes_from_the_environment(monkeypatch):
    from sluice.core import envs

    before = fp8_recipe.recipe()
    assert before == Fp8Recipe()
    monkeypatch.setenv("SLUICE_FP8_WEIGHT_SCALE", "max")
    monkeypatch.setenv("SLUICE_FP8_DENSE_LAST_LAYERS", "0")
    try:
        envs.configure_kernels()
        assert fp8_recipe.recipe() == Fp8Recipe("max", 0)
        model = _model()
        dense = [m["proj"].weight.detach().clone() for m in model.model.layers]
        assert quantize_model_fp8(model) == {"fp8": 3, "dense": 0}
        for m, w in zip(model.model.layers, dense):
            assert m["proj"].weight_scale_rule == "max"
            assert torch.allclose(m["proj"].weight_scale, w.abs().amax(dim=1) / 448)
        monkeypatch.delenv("SLUICE_FP8_WEIGHT_SCALE")
        monkeypatch.delenv("SLUICE_FP8_DENSE_LAST_LAYERS")
        envs.configure_kernels()  # unset leaves the process's recipe
        assert fp8_recipe.recipe() == Fp8Recipe("max", 0)
    finally:
        fp8_recipe.configure(before.weight_scale, before.dense_last_layers)
    with fp8_recipe.recipe_as(Fp8Recipe("max", 2)):
        assert fp8_recipe.recipe() == Fp8Recipe("max", 2)
    assert fp8_recipe.recipe() == Fp8Recipe()


def test_the_lm_head_is_fp8_only_where_the_recipe_asks_and_no_draft_head_reads_it(monkeypatch):
    from sluice.core import envs
    from sluice.core.models.quant import quantize_model

    with fp8_recipe.recipe_as(Fp8Recipe(dense_last_layers=0, lm_head=True)):
        model = _model()
        assert quantize_model(model, "fp8") == {"fp8": 4, "dense": 0}
        assert type(model.lm_head) is Fp8Linear
        speculating = _model()  # the engine passes include_lm_head=False with a draft head
        assert quantize_model(speculating, "fp8", include_lm_head=False) == {"fp8": 3, "dense": 0}
        assert type(speculating.lm_head) is nn.Linear
    model = _model()
    quantize_model(model, "fp8")  # the default recipe: the head stays dense
    assert type(model.lm_head) is nn.Linear
    monkeypatch.setenv("SLUICE_FP8_LM_HEAD", "1")
    try:
        envs.configure_kernels()
        assert fp8_recipe.recipe().lm_head
    finally:
        monkeypatch.delenv("SLUICE_FP8_LM_HEAD")
        fp8_recipe.configure(lm_head=False)
    assert fp8_recipe.recipe() == Fp8Recipe()


def test_a_tied_head_gets_an_fp8_copy_of_the_embedding_table():
    model = _model()
    model.lm_head = None  # tied, as the default model's: the logits are the hidden states times the table
    model.model.embed_tokens = nn.Embedding(8, 16)
    table = model.model.embed_tokens.weight.detach().clone()
    with fp8_recipe.recipe_as(Fp8Recipe(lm_head=True)):
        assert quantize_model_fp8(model, include_lm_head=True) == {"fp8": 3, "dense": 1}
    head = model.lm_head
    assert type(head) is Fp8Linear and (head.out_features, head.in_features) == (8, 16)
    assert torch.equal(model.model.embed_tokens.weight, table)  # lookups read the table as it was
    x = torch.randn(3, 16)
    ref = x @ table.t()
    assert (head(x) - ref).norm() < 0.05 * ref.norm()  # e4m3's rounding of x and of the table, no more
