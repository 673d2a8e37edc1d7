"""The model runner's step inputs (vectorized, into preallocated buffers) and its decode-graph path.

CUDA graphs need a GPU, but everything around a replay does not: a stand-in that runs the captured
function eagerly over the same static buffers and padded batch sizes exercises the padding, the
planning for the longest context and the logit-row selection on the CPU (Triton under the interpreter).
"""

from __future__ import annotations

import numpy as np
import pytest
from sluice.core import LLM, SamplingParams
from sluice.core.args import EngineArgs
from sluice.core.cuda_graphs import graph_batch_sizes
from sluice.core.model_runner import ModelRunner
from sluice.core.models.loader import resolve_model
from sluice.core.step import ScheduledRequest

from tests.graph_helpers import EagerReplay


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    args = EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=8)
    return ModelRunner(args, resolve_model("dummy:tiny"), max_model_len=256)


def test_prepare_matches_a_plain_reference(runner: ModelRunner):
    greedy = SamplingParams(temperature=0)
    reqs = [
        ScheduledRequest("a", [5, 6, 7, 8, 9], 30, [4, 9, 2], True, greedy),  # chunk after 30 cached tokens
        ScheduledRequest("b", [11], 16, [7, 3], True, greedy),  # decode at the first slot of its 2nd block
        ScheduledRequest("c", [1, 2, 3], 0, [12], False),  # prefill chunk that does not sample yet
        ScheduledRequest("d", [42], 47, [1, 5, 8, 6, 0], True, greedy),  # longer table than needed
    ]
    b = runner.buffers
    b.block_tables_np.fill(-7)  # stale rows from earlier steps must not leak into the owned prefixes
    num_rows = runner._prepare(reqs, b, graph_bs=None)
    meta = runner._metadata(reqs, b, len(reqs))
    bs = runner.block_size
    ids, pos, slots, rows = [], [], [], []
    for r in reqs:
        for j, t in enumerate(r.token_ids):
            p = r.start_pos + j
            ids.append(t)
            pos.append(p)
            slots.append(r.block_table[p // bs] * bs + p % bs)
        if r.sample:
            rows.append(len(ids) - 1)
    assert b.input_ids[: len(ids)].tolist() == ids
    assert b.positions[: len(pos)].tolist() == pos
    assert meta.slot_mapping.tolist() == slots
    assert meta.query_start_loc.tolist() == [0, 5, 6, 9, 10]
    assert meta.seq_lens.tolist() == [35, 17, 3, 48]
    assert (meta.max_query_len, meta.max_seq_len) == (5, 48)
    assert num_rows == 3 and b.logit_rows[:num_rows].tolist() == rows
    for i, r in enumerate(reqs):
        assert meta.block_tables[i, : len(r.block_table)].tolist() == r.block_table


def test_prepare_pads_a_graph_batch_with_rows_that_touch_no_kv(runner: ModelRunner):
    greedy = SamplingParams(temperature=0)
    reqs = [ScheduledRequest(f"r{i}", [100 + i], 20 + i, [i, 10 + i], True, greedy) for i in range(3)]
    b = runner.buffers
    b.slot_mapping_np.fill(99)
    b.seq_lens_np.fill(99)
    runner._prepare(reqs, b, graph_bs=4)
    assert b.slot_mapping[:4].tolist() == [(10 + i) * 16 + (20 + i) % 16 for i in range(3)] + [-1]
    assert b.seq_lens[:4].tolist() == [21, 22, 23, 0]
    assert b.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    assert b.positions[:4].tolist() == [20, 21, 22, 0]


def test_graph_batch_sizes_cover_every_batch():
    sizes = graph_batch_sizes(256)
    assert sizes[0] == 1 and sizes[-1] == 256 and sizes == sorted(set(sizes))
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    # padding adds at most half a step from 16 up, at most an eighth beyond 256
    assert all(b / a <= 1.5 for a, b in zip(sizes, sizes[1:]) if a >= 16)
    assert all(b / a <= 1.125 for a, b in zip(graph_batch_sizes(1024), graph_batch_sizes(1024)[1:]) if a >= 256)


def test_decode_through_the_graph_path_matches_eager():
    kw = dict(model="dummy:tiny", device="cpu", attention_backend="triton", num_kv_blocks=64, max_model_len=1024)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], list(range(40, 61)), [7] * 3]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(**kw) as llm:
        eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(**kw) as llm:
        runner = llm.engine._executor.runner
        graphs = EagerReplay(runner._decode_forward, runner.buffers, [1, 2, 4], runner.max_model_len)
        graphs.capture()
        runner.graphs = graphs
        graphed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        # a sampled-but-unused padding row, and one request finishing early (batch 3 -> pad to 4, then 2)
        short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        mixed = llm.generate(prompts, [params, short, params], use_tqdm=False)
    assert graphed == eager
    assert [o.outputs[0].token_ids for o in mixed] == [eager[0], eager[1][:2], eager[2]]
    assert 4 in graphs.replayed and set(graphs.replayed) <= {1, 2, 4}  # 3 running requests padded to 4
    assert np.all(np.array([len(t) for t in graphed]) == 6)


def test_requests_submitted_together_share_their_first_step():
    import anyio
    from sluice.app.bench.common import drive_engine
    from sluice.app.bench.datasets import sample_random
    from sluice.core import AsyncEngine

    async def go() -> int:
        async with AsyncEngine(model="dummy:tiny", device="cpu", num_kv_blocks=64) as engine:
            before = engine.stats().num_steps
            run = await drive_engine(engine, sample_random(8, 10, 4, 1000, seed=1))
            assert run.output_lens == [4] * 8
            return engine.stats().num_steps - before

    # one prefill step for all eight (it samples each one's first token), then three decode steps
    assert anyio.run(go) == 4
