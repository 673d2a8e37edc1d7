"""The torch reference paged attention equals dense causal attention written out by hand.

The reference here is deliberately naive: each sequence's K/V are read position by position through
its (shuffled) block table, KV heads are repeated for GQA, and softmax(QK^T * scale + causal mask) V is
computed in float64. The backend under test gathers through block tables, batches decode rows into one
padded call and masks chunked prefill by offset; every path is covered.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sluice.kv.attention import TorchAttentionBackend, get_attention_backend, torch_ref

from tests.helpers import random_paged_batch

BACKEND = TorchAttentionBackend()
SCALE = 0.125


def dense_attention(query: torch.Tensor, cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
    block_size = cache.shape[2]
    num_heads, num_kv_heads = query.shape[1], cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    qsl, lens = meta.query_start_loc_host, meta.seq_lens_host
    for i in range(meta.num_seqs):
        s, e, n = qsl[i], qsl[i + 1], lens[i]
        where = [(int(meta.block_tables[i, p // block_size]), p % block_size) for p in range(n)]
        k = torch.stack([cache[0, b, o] for b, o in where]).double()  # [n, Hk, D]
        v = torch.stack([cache[1, b, o] for b, o in where]).double()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # head h -> kv head h // group
        q = query[s:e].double()  # [nq, H, D], at positions n - nq ... n - 1
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        qpos = torch.arange(n - (e - s), n)[:, None]
        scores = scores.masked_fill(torch.arange(n)[None, :] > qpos, float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def _assert_matches_dense(seq_lens, q_lens, group, block_size=16, seed=0, head_dim=32):
    query, cache, meta = random_paged_batch(seq_lens, q_lens, 2, group, head_dim, block_size, seed=seed)
    out = BACKEND.forward(query, cache, meta, SCALE)
    assert out.shape == query.shape and out.dtype == query.dtype
    ref = dense_attention(query, cache, meta, SCALE)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    return query, cache, meta, out


def test_backend_registry():
    assert isinstance(get_attention_backend("torch"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="attention backend"):
        get_attention_backend("nope")


def test_block_tables_are_shuffled_and_padded():
    """The inputs exercise what they should: non-contiguous, out-of-order blocks and padded tables."""
    _, _, meta = random_paged_batch([40, 70], [40, 70], 2, 1, 8, seed=0)
    owned = meta.block_tables[0, :3].tolist() + meta.block_tables[1, :5].tolist()
    assert owned != sorted(owned) and len(set(owned)) == len(owned) and 0 not in owned
    assert meta.block_tables[0, 3:].eq(0).all() and meta.block_tables[1, 5:].eq(0).all()  # padding -> block 0


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [8, 16])
def test_prefill_from_scratch(group, block_size):
    _assert_matches_dense([1, 15, 16, 17, 33, 70], [1, 15, 16, 17, 33, 70], group, block_size, seed=group)


@pytest.mark.parametrize("group", [1, 4])
def test_chunked_prefill_over_cached_context(group):
    # chunks starting mid-block, on a block boundary, and a chunk that is one token short of the whole
    _assert_matches_dense([100, 48, 47, 33], [20, 16, 15, 32], group, seed=10 + group)


@pytest.mark.parametrize("group", [1, 3])
def test_decode_batch(group):
    """Several one-token rows take the batched, padded decode path."""
    _assert_matches_dense([1, 15, 16, 17, 64, 130], [1] * 6, group, seed=20 + group)


def test_single_decode_row():
    _assert_matches_dense([37], [1], 2, seed=5)


@pytest.mark.parametrize("group", [1, 3])
def test_mixed_prefill_chunks_and_decodes(group):
    """Decode rows interleaved with prefill rows: the batched decode writes back to the right rows."""
    _assert_matches_dense([50, 17, 1, 130, 16, 65, 40], [50, 1, 1, 10, 1, 1, 8], group, seed=30 + group)


def test_decodes_of_very_different_lengths_split_into_calls(monkeypatch):
    """Decodes (and 3-query verifications) spread from 1 to 900 tokens are grouped by length into several
    padded calls, each bounded in padding, and still match the dense reference row for row."""
    monkeypatch.setattr(torch_ref, "MAX_PADDING_TOKENS", 64)
    lens = [900, 1, 17, 300, 33, 310, 64, 5, 320, 640, 7, 100]
    q_lens = [1] * 9 + [3] * 3
    query, cache, meta, _ = _assert_matches_dense(lens, q_lens, 3, seed=11)
    plan = BACKEND._make_plan(meta, 16, query.device)
    assert len(plan.calls) > 4 and not plan.singles
    covered = sorted(int(r) for c in plan.calls for r in c.rows_q.flatten())
    assert covered == list(range(query.shape[0]))
    for call in plan.calls:
        assert call.mask.shape[-1] == call.max_len


@pytest.mark.parametrize("lens", [[5], [1, 1, 1], [3, 10, 10, 50, 51, 400], list(range(1, 200, 7))])
def test_split_by_padding_bounds_each_run(lens):
    runs = torch_ref._split_by_padding(lens, 40)
    assert runs[0][0] == 0 and runs[-1][1] == len(lens)
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
    for start, end in runs:
        part = lens[start:end]
        assert end > start and (len(part) == 1 or len(part) * part[-1] - sum(part) <= 40)


def test_wrong_block_table_is_detected():
    """Guards the comparison: pointing one table entry at another (unowned) block changes the output.
    (Swapping two blocks of a decode row would not: a lone query sees a set of keys, in any order.)"""
    query, cache, meta, out = _assert_matches_dense([40, 1], [1, 1], 2, seed=7)
    tables = meta.block_tables.clone()
    tables[0, 1] = 0
    # A new step's metadata (backends may plan a step once, on its metadata's first use)
    meta = dataclasses.replace(meta, block_tables=tables)
    assert not torch.allclose(BACKEND.forward(query, cache, meta, SCALE), out, atol=1e-3)


def test_write_kv_lands_at_slots():
    g = torch.Generator().manual_seed(3)
    num_blocks, block_size, num_kv_heads, head_dim = 6, 4, 2, 8
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    before = cache.clone()
    num_tokens = 9
    # K and V as views into a fused projection (non-contiguous), as the model passes them
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=g)
    key, value = fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[2, 6]] = -1  # padding rows: written nowhere
    BACKEND.write_kv(key, value, cache, slots)
    written = set()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, block_size)
        assert torch.equal(cache[0, b, o], key[t]) and torch.equal(cache[1, b, o], value[t])
        written.add((b, o))
    for b in range(num_blocks):
        for o in range(block_size):
            if (b, o) not in written:
                assert torch.equal(cache[:, b, o], before[:, b, o])


def test_write_then_attend_chunk_sees_its_own_keys():
    """A chunk's K/V written through its slot mapping are what its queries attend to (causally)."""
    seq_lens, q_lens = [45, 20], [13, 20]
    query, cache, meta = random_paged_batch(seq_lens, q_lens, 2, 2, 16, seed=9)
    g = torch.Generator().manual_seed(4)
    key = torch.randn(query.shape[0], 2, 16, generator=g)
    value = torch.randn(query.shape[0], 2, 16, generator=g)
    BACKEND.write_kv(key, value, cache, meta.slot_mapping)
    out = BACKEND.forward(query, cache, meta, SCALE)
    # the last query of sequence 1 (a full prefill) by hand from the written K/V alone
    q = query[-1]  # [4, 16]
    k = key[13:].repeat_interleave(2, dim=1)  # [20, 4, 16]
    v = value[13:].repeat_interleave(2, dim=1)
    p = (torch.einsum("hd,khd->hk", q, k) * SCALE).softmax(-1)
    torch.testing.assert_close(out[-1], torch.einsum("hk,khd->hd", p, v), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), dense_attention(query, cache, meta, SCALE), rtol=1e-5, atol=1e-5)
