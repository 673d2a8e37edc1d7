"""A draft head beside a quantized target on the CPU: the head's projections and its LM head rounded to int4 for
torch's packed kernels (`Int4PackedLinear.rounded_from`), the target keeping its int8 copy of a tied LM head, and
greedy speculation still emitting the plain engine's tokens."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from sluice.core import LLM, SamplingParams
from sluice.core.models import cpu_linear
from sluice.core.models.cpu_linear import Int4PackedLinear, Int8PackedLinear, round_linears_to_int4
from sluice.core.models.loader import resolve_model
from sluice.core.models.quant import dequantize_int4, quantize_int4
from sluice.spec.eagle import target_lm_weight
from torch import nn

from tests.spec_helpers import copy_head_dir

pytestmark = pytest.mark.skipif(
    not cpu_linear.packed_kernels_available(), reason="torch's packed CPU matmuls need AVX2 or AVX-512"
)

MODEL = "dummy:tiny"
COMMON = dict(
    device="cpu", dtype="bfloat16", quantization="int4", num_kv_blocks=256, max_num_batched_tokens=48, max_model_len=256
)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def test_rounded_int4_is_the_int4_format_in_groups_of_32_and_shares_its_weight():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 128, generator=g) * 0.05).bfloat16()
    bias = torch.randn(96, generator=g).bfloat16()
    lin = Int4PackedLinear.rounded_from(w, bias)
    assert lin.group_size == cpu_linear.ROUNDED_GROUP_SIZE == 32
    few = torch.randn(3, 128, generator=g).bfloat16()
    ref = F.linear(few.float(), dequantize_int4(*quantize_int4(w, 32), torch.float32), bias.float())
    assert _rel_err(lin(few), ref) < 2.0**-6  # bf16 scales and activations
    assert lin.dense_weight().data_ptr() == w.data_ptr()  # many rows multiply the weight it was rounded from
    many = torch.randn(Int4PackedLinear.DENSE_MIN_ROWS, 128, generator=g).bfloat16()
    assert torch.equal(lin(many), F.linear(many, w, bias))


def test_round_linears_to_int4_replaces_every_linear_of_a_module():
    torch.manual_seed(1)
    module = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 64, bias=False))).bfloat16()
    ref = copy.deepcopy(module).float()  # its weights rounded as `rounded_from` does, computed in fp32
    with torch.no_grad():
        for lin in (ref[0], ref[2][0]):
            lin.weight.copy_(dequantize_int4(*quantize_int4(lin.weight.bfloat16(), 32), torch.float32))
    assert round_linears_to_int4(module) == 2
    assert not any(isinstance(m, nn.Linear) for m in module.modules())
    x = torch.randn(2, 64).bfloat16()
    with torch.no_grad():
        assert _rel_err(module(x), ref(x.float())) < 2.0**-5  # bf16 activations through two layers


@pytest.fixture(scope="module")
def copy_head(tmp_path_factory):
    return copy_head_dir(tmp_path_factory.mktemp("spec-cpu"), MODEL, resolve_model(MODEL).config)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_speculation_on_a_packed_target_and_head_equals_plain(copy_head):
    prompts = [[5 + (7 * i + 3 * j) % 400 for j in range(9 + 5 * i)] for i in range(3)]
    with LLM(MODEL, **COMMON) as plain:
        want = _greedy(plain, prompts)
    with LLM(MODEL, speculative_model=copy_head, num_speculative_tokens=3, **COMMON) as spec:
        runner = spec.engine.local_core.executor.runner
        model, drafter = runner.model, runner.drafter
        assert isinstance(model.lm_head, Int8PackedLinear)  # the tied head's int8 copy verifies, as in plain steps
        assert target_lm_weight(model).data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert drafter.cpu_packed
        assert isinstance(drafter.proposer.lm_head, Int4PackedLinear)
        assert not any(isinstance(m, nn.Linear) for m in drafter.head.modules())
        got = _greedy(spec, prompts)
        assert spec.engine.stats().spec_num_drafts > 0
    assert got == want


def test_a_quantized_cpu_model_drafts_3_by_default():
    from sluice.core import EngineArgs

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert EngineArgs().resolve_num_speculative_tokens(gpu, None) == 4
    assert EngineArgs().resolve_num_speculative_tokens(cpu, None) == 4  # the fp32 reference
    assert EngineArgs().resolve_num_speculative_tokens(cpu, "int4") == 3  # the packed kernels' blocks of 4 rows
    assert EngineArgs(num_speculative_tokens=5).resolve_num_speculative_tokens(cpu, "int4") == 5


def test_a_quantized_cpu_model_drafts_over_the_first_8192_ids_by_default():
    from sluice.core import EngineArgs

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert EngineArgs().resolve_speculative_draft_vocab_size(gpu, None) == 0  # the head's own
    assert EngineArgs().resolve_speculative_draft_vocab_size(cpu, None) == 0  # the fp32 reference
    assert EngineArgs().resolve_speculative_draft_vocab_size(cpu, "int4") == 8192
    assert EngineArgs(speculative_draft_vocab_size=0).resolve_speculative_draft_vocab_size(cpu, "int4") == 0


@pytest.mark.parametrize("size", [-1, (1 << 24) + 1])
def test_a_draft_vocabulary_out_of_range_is_refused(size):
    from sluice.core import EngineArgs
    from sluice.core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="speculative_draft_vocab_size"):
        EngineArgs(speculative_draft_vocab_size=size)


def test_a_restricted_draft_vocabulary_drafts_only_its_ids_and_emits_the_plain_tokens(copy_head):
    size = 300  # the prompts' ids and some of the random model's own; rounded up to whole tiles of 64: 320
    prompts = [[5 + (7 * i + 3 * j) % 400 for j in range(9 + 5 * i)] for i in range(3)]
    with LLM(MODEL, **COMMON) as plain:
        want = _greedy(plain, prompts)
    with LLM(MODEL, speculative_model=copy_head, speculative_draft_vocab_size=size, **COMMON) as spec:
        drafter = spec.engine.local_core.executor.runner.drafter
        assert torch.equal(drafter.head.draft_vocab, torch.arange(320))
        assert drafter.proposer.lm_head.out_features == 320  # the int4 head scores only those rows
        drafted: list[int] = []
        propose = drafter.propose

        def spy(*a, **k):
            out = propose(*a, **k)
            drafted.extend(t for d in (out or {}).values() for t in d)
            return out

        drafter.propose = spy
        got = _greedy(spec, prompts)
    assert drafted and max(drafted) < 320
    assert got == want
