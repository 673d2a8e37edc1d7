"""The torch attention's batched bf16 decode call (`torch_ref._decode_folded`): which calls take it, and its
output against the fp32 path's within a few bf16 roundings (2^-8 each) of the output's scale."""

from __future__ import annotations

import pytest
import torch
from sluice.kv.attention import torch_ref
from sluice.kv.attention.torch_ref import TorchAttentionBackend

from tests.helpers import random_paged_batch


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("window", [0, 24])
def test_batched_bf16_decodes_fold_gqa_and_match_the_fp32_path(monkeypatch, window):
    """Decodes of mixed lengths (two calls after the padding split) with GQA: the folded bf16 call against the
    same backend with folding off (K/V upcast to fp32)."""
    monkeypatch.setattr(torch_ref, "MAX_PADDING_TOKENS", 64)
    lens = [5, 17, 40, 41, 130, 150, 170]
    query, cache, meta = random_paged_batch(lens, [1] * len(lens), 3, 3, 32, dtype=torch.bfloat16, seed=4)
    folded = TorchAttentionBackend()
    calls = []
    real = torch_ref._decode_folded
    monkeypatch.setattr(torch_ref, "_decode_folded", lambda *a: calls.append(a[3].numel()) or real(*a))
    got = folded.forward(query, cache, meta, 0.125, window=window)
    assert sorted(calls) == [3, 4] and len(folded._plan.calls) == 2
    monkeypatch.setattr(torch_ref, "FOLD_MIN_SEQS", 10**6)  # the fp32 path for the same calls
    want = TorchAttentionBackend().forward(query, cache, meta, 0.125, window=window)
    assert len(calls) == 2 and got.dtype == torch.bfloat16
    assert _rel_err(got, want) < 2.0**-6


@pytest.mark.parametrize(
    "dtype,num_seqs,softcap,fp8_scale,expected",
    [
        (torch.bfloat16, 2, 0.0, False, True),
        (torch.bfloat16, 1, 0.0, False, False),  # batch-1 decode keeps its path
        (torch.float32, 8, 0.0, False, False),  # fp32 models keep theirs
        (torch.bfloat16, 8, 30.0, False, False),  # a soft-cap needs the logits
        (torch.bfloat16, 8, 0.0, True, False),  # fp8 K/V are dequantized on the other path
    ],
)
def test_which_batched_calls_fold(dtype, num_seqs, softcap, fp8_scale, expected):
    query, cache, meta = random_paged_batch([20] * num_seqs, [1] * num_seqs, 2, 3, 16, dtype=dtype)
    call = TorchAttentionBackend._make_plan(meta, cache.shape[2], query.device).calls[0]
    variant = torch_ref._Variant(0, softcap) if softcap else None
    kv_scale = torch.ones(2) if fp8_scale else None
    assert torch_ref._folds(query, cache, call, kv_scale, variant) is expected
