"""The model runner's step inputs (vectorized, into preallocated buffers) and its decode-graph path.

CUDA graphs need a GPU, but everything around a replay does not: a stand-in that runs the captured
function eagerly over the same static buffers and padded batch sizes exercises the padding, the
planning for the longest context and the logit-row selection on the CPU (Triton under the interpreter).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sluice.core import LLM, SamplingParams
from sluice.core.step import NewRequest, SchedulerOutput
from sluice.core.worker.cuda_graphs import DecodeGraphs, fastest_routes, graph_batch_sizes, mixed_graph_sizes
from sluice.core.worker.input_batch import InputBatch
from sluice.core.worker.step_buffers import StepBuffers

from tests.graph_helpers import EagerMixedReplay, EagerReplay


def step_of(rows, step_id: int = 1) -> SchedulerOutput:
    """A step whose rows are all new requests: (id, arrived tokens, start, computed, block table, samples)."""
    so = SchedulerOutput(step_id)
    for rid, tokens, start, q, table, samples in rows:
        so.new_requests.append(NewRequest(rid, tokens, len(tokens), table, SamplingParams(temperature=0)))
        so.req_ids.append(rid)
        so.num_computed_tokens.append(start)
        so.num_scheduled_tokens.append(q)
        so.samples.append(samples)
    return so


def test_build_matches_a_plain_reference():
    batch = InputBatch(8, 16, 16)
    rows = [
        ("a", list(range(100, 135)), 30, 5, [4, 9, 2], True),  # chunk after 30 cached tokens
        ("b", list(range(200, 216)), 0, 16, [7, 3], True),  # a whole prompt ending at its 1st block
        ("c", [1, 2, 3, 4], 0, 3, [12], False),  # prefill chunk that does not sample yet
        ("d", list(range(48)), 40, 8, [1, 5, 8, 6, 0], True),  # longer table than needed
    ]
    so = step_of(rows)
    batch.apply(so)
    b = StepBuffers(64, 8, 16, torch.device("cpu"))
    b.block_tables_np.fill(-7)  # stale rows from earlier steps must not leak into the owned prefixes
    got = batch.build(so, b)
    ids, pos, slots = [], [], []
    for _, tokens, start, q, table, _ in rows:
        for p in range(start, start + q):
            ids.append(tokens[p])
            pos.append(p)
            slots.append(table[p // 16] * 16 + p % 16)
    assert got.num_tokens == len(ids)
    assert b.input_ids_np[: len(ids)].tolist() == ids
    assert b.positions_np[: len(pos)].tolist() == pos
    assert b.slot_mapping_np[: len(slots)].tolist() == slots
    assert got.query_start_loc.tolist() == [0, 5, 21, 24, 32]
    assert b.seq_lens_np[:4].tolist() == [35, 16, 3, 48]
    for i, row in enumerate(rows):
        assert b.block_tables_np[i, : len(row[4])].tolist() == row[4]


def test_step_buffers_are_disjoint_views_of_one_arena():
    """Every input field is its own aligned piece of one arena (one host -> device copy can send a step's
    inputs), block tables after the per-step fields (the copy sends a prefix of the arena)."""
    b = StepBuffers(40, 5, 7, torch.device("cpu"))
    names = ["query_start_loc", "seq_lens", "logit_rows", "gather_src", "gather_dst", "input_ids", "positions"]
    names += ["slot_mapping", "block_tables", "sampling_f", "top_k"]
    for value, name in enumerate(names, 1):
        getattr(b, name + "_np")[...] = value
    for value, name in enumerate(names, 1):
        view = getattr(b, name)
        assert (view == value).all(), name
        assert view.data_ptr() % 64 == 0
    offsets = [getattr(b, n).data_ptr() for n in names]
    assert offsets == sorted(offsets)
    assert b.block_tables.shape == (5, 7) and b.input_ids.shape == (40,) and b.sampling_f.shape == (6, 5)


def test_decodes_take_the_last_token_from_the_host_or_from_the_step_in_flight():
    """After a step samples, the next step's decode reads the token on the device (its row in that step's
    samples) until it is read back; then from the host."""
    batch = InputBatch(8, 16, 16)
    so = step_of([("a", [5, 6, 7], 0, 3, [1], True), ("b", [8, 9], 0, 2, [2], True)])
    batch.apply(so)
    b = StepBuffers(64, 8, 16, torch.device("cpu"))
    batch.build(so, b)
    batch.sampled(np.array([0, 1]), 1, np.array([0, 1]))
    nxt = SchedulerOutput(2, ["b", "a"], [1, 1], [2, 3], [True, True])
    rows = batch.build(nxt, b)
    assert rows.gather_dst.tolist() == [0, 1] and rows.gather_src.tolist() == [1, 0]
    batch.read_back(np.array([0, 1]), 1, np.array([70, 80]))
    rows = batch.build(nxt, b)
    assert rows.gather_dst.size == 0 and b.input_ids_np[:2].tolist() == [80, 70]
    assert b.positions_np[:2].tolist() == [2, 3]


def test_a_dropped_slot_is_reused_from_the_next_step_on():
    """Not in the step that drops it (the step in flight then may still report a token for it), but in the next
    one: the executor collects the step in flight before it launches another."""
    batch = InputBatch(2, 4, 16)
    batch.apply(step_of([("a", [1], 0, 1, [0], True)]))
    replaced = step_of([("b", [1], 0, 1, [1], True), ("c", [1], 0, 1, [2], True)], 2)
    replaced.finished_request_ids = ["a"]
    with pytest.raises(RuntimeError, match="full"):  # a's slot still cooling down
        batch.apply(replaced)
    batch = InputBatch(2, 4, 16)
    batch.apply(step_of([("a", [1], 0, 1, [0], True)]))
    replaced = step_of([("b", [1], 0, 1, [1], True)], 2)
    replaced.finished_request_ids = ["a"]
    batch.apply(replaced)
    batch.apply(step_of([("c", [1], 0, 1, [2], True)], 3))
    assert batch.slot_of == {"b": 1, "c": 0}


def test_a_batch_replaced_every_step_fits_the_persistent_batch():
    """Prompts that end at their first token under a full queue: every step drops a whole batch and admits
    another (a prefill engine's steady state). One dropped batch cools down at a time, so the runner's slots
    (two batches and two) hold it; with the last two steps' batches cooling, the third such step found it full."""
    prompts = [[100 + i, 7, 9] for i in range(4 * 4)]
    with LLM(
        model="dummy:tiny", device="cpu", num_kv_blocks=16, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64
    ) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1] * len(prompts)


def test_build_pads_a_graph_batch_with_rows_that_touch_no_kv():
    batch = InputBatch(8, 16, 16)
    so = step_of([(f"r{i}", list(range(21 + i)), 20 + i, 1, [i, 10 + i], True) for i in range(3)])
    batch.apply(so)
    b = StepBuffers(64, 8, 16, torch.device("cpu"))
    b.slot_mapping_np.fill(99)
    b.seq_lens_np.fill(99)
    batch.build(so, b, pad_to=4)
    assert b.slot_mapping_np[:4].tolist() == [(10 + i) * 16 + (20 + i) % 16 for i in range(3)] + [-1]
    assert b.seq_lens_np[:4].tolist() == [21, 22, 23, 0]
    assert b.query_start_loc_np[:5].tolist() == [0, 1, 2, 3, 4]
    assert b.positions_np[:4].tolist() == [20, 21, 22, 0]


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
        runner = llm.engine.local_core.executor.runner
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


def test_rope_in_the_decode_kernel_gives_the_engines_tokens(monkeypatch):
    """With the fused kernels on the Triton backend, RoPE in the decode kernel (it rotates and stores each decode
    step's keys and values, `kv/attention/triton_kernels.py`) gives the tokens and logprobs of the RoPE kernel's
    path (SLUICE_DECODE_ROPE=0), eager and through decode graph stand-ins (padding rows included): every later step
    reads the keys the fused kernel stored."""
    kw = dict(
        model="dummy:tiny", device="cpu", attention_backend="triton", fused_kernels="on", num_kv_blocks=64,
        max_model_len=256, enable_prefix_caching=False,  # the second run computes its prompts again, as the first
    )  # fmt: skip
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], list(range(40, 61)), [7] * 3]
    # the logprobs too: a random tiny model's greedy tokens barely depend on attention, its distributions do
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)

    def run(rope_in_decode: bool) -> tuple[list, list]:
        """Eager, then through graph stand-ins (planned for the longest context: other split counts)."""
        monkeypatch.setenv("SLUICE_DECODE_ROPE", "1" if rope_in_decode else "0")
        with LLM(**kw) as llm:
            runner = llm.engine.local_core.executor.runner
            assert runner.backend.rope_in_decode == rope_in_decode and runner.model.rotary.fused_write is not None
            got = []
            for graphed in (False, True):
                if graphed:
                    runner.graphs = EagerReplay(runner._decode_forward, runner.buffers, [1, 2, 4], runner.max_model_len)
                    runner.graphs.capture()
                outs = llm.generate(prompts, params, use_tqdm=False)
                got.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
            assert 4 in runner.graphs.replayed  # 3 running requests padded to 4
        return got[0], got[1]

    assert run(True) == run(False)


def test_build_pads_a_mixed_graph_step_with_tokens_and_rows_of_nothing():
    batch = InputBatch(8, 16, 16)
    so = step_of([("a", list(range(30)), 20, 10, [3, 4], True), ("b", list(range(6)), 5, 1, [9], True)])
    batch.apply(so)
    b = StepBuffers(64, 8, 16, torch.device("cpu"))
    for buf in (b.input_ids_np, b.positions_np, b.slot_mapping_np, b.seq_lens_np, b.query_start_loc_np):
        buf.fill(99)
    batch.build(so, b, pad_to=4, pad_tokens_to=16)
    assert b.query_start_loc_np[:5].tolist() == [0, 10, 11, 11, 11]  # padding rows own no tokens
    assert b.seq_lens_np[:4].tolist() == [30, 6, 0, 0]
    assert b.slot_mapping_np[11:16].tolist() == [-1] * 5 and b.positions_np[11:16].tolist() == [0] * 5
    assert b.input_ids_np[:11].tolist() == list(range(20, 30)) + [5]
    assert b.input_ids_np[11:16].tolist() == [0] * 5


def test_mixed_graph_sizes_cover_every_step():
    sizes = mixed_graph_sizes(8192)
    assert sizes[0] == 16 and sizes[-1] == 8192 and sizes == sorted(set(sizes))
    assert all(b / a <= 1.125 for a, b in zip(sizes, sizes[1:]) if a >= 128)
    assert mixed_graph_sizes(100) == [16, 32, 48, 64, 80, 96, 100]


@pytest.mark.parametrize("routed", [False, True])
def test_steps_with_prefill_rows_through_the_mixed_graph_path_match_eager(routed):
    """Prompts of many lengths, prefilled in chunks beside running decodes, some over cached prefixes: every
    step through the mixed-step (and decode) graph stand-ins gives the eager engine's tokens; also with small
    sizes routed to larger graphs (`DecodeGraphs.route_to_fastest`), whose extra rows are padding."""
    kw = dict(
        model="dummy:tiny", device="cpu", attention_backend="triton", num_kv_blocks=96, max_model_len=512,
        max_num_batched_tokens=100, max_num_seqs=8,
    )  # fmt: skip
    shared = list(range(100, 140))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], shared + [7, 8], list(range(40, 141)), [7] * 3, shared + [9] * 20]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with LLM(**kw) as llm:
        eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(**kw) as llm:
        runner = llm.engine.local_core.executor.runner
        runner.graphs = EagerReplay(runner._decode_forward, runner.buffers, [1, 2, 4, 8], runner.max_model_len)
        runner.mixed_graphs = EagerMixedReplay(runner._forward, runner.buffers, [16, 32, 64, 100], runner.max_model_len)
        for g in (runner.graphs, runner.mixed_graphs):
            g.capture()
        if routed:
            runner.graphs.routes, runner.mixed_graphs.routes = {1: 4, 2: 4}, {16: 64, 32: 64}
        graphed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert graphed == eager
    replayed = runner.mixed_graphs.replayed
    if routed:
        assert set(replayed) <= {64, 100} and set(runner.graphs.replayed) <= {4, 8}, replayed
        assert 64 in replayed and 4 in runner.graphs.replayed
    else:
        assert set(replayed) <= {16, 32, 64, 100} and len(set(replayed)) >= 2, replayed
    assert runner.graphs.replayed  # the decode-only steps still take the decode graphs


def test_route_to_fastest_times_each_graph_and_routes_steps_by_it(monkeypatch):
    # the device's clock stood in for by the host's, the graphs by ones that take a set time per replay
    import time as _time

    class Clock:
        def __init__(self, enable_timing: bool = False) -> None:
            self.at = 0.0

        def record(self) -> None:
            self.at = _time.perf_counter()

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: Clock) -> float:
            return 1e3 * (end.at - self.at)

    class Graph:
        def __init__(self, seconds: float) -> None:
            self.seconds = seconds

        def replay(self) -> None:
            _time.sleep(self.seconds)

    monkeypatch.setattr(torch.cuda, "Event", Clock)
    graphs = DecodeGraphs(None, StepBuffers(16, 4, 4, torch.device("cpu")), [1, 2, 4], 64)
    graphs.graphs = {1: (Graph(0.012), None), 2: (Graph(0.004), None), 4: (Graph(0.008), None)}
    times = graphs.route_to_fastest()
    assert times[1] > times[4] > times[2]
    assert graphs.routes == {1: 2} and [graphs.padded_size(n) for n in (1, 2, 3, 4, 5)] == [2, 2, 4, 4, None]


def test_graphs_keep_their_smallest_size_when_timing_them_fails():
    from types import SimpleNamespace

    from sluice.core.worker.model_runner import ModelRunner

    class Failing:
        routes = {1: 2}

        def route_to_fastest(self):
            raise RuntimeError("no timing events here")

    runner = SimpleNamespace(graphs=Failing(), mixed_graphs=None)
    ModelRunner._route_graphs(runner)  # logged, not raised: routing is only a speed-up
    assert runner.graphs.routes == {}


def test_fastest_routes_send_a_size_only_to_a_larger_and_clearly_faster_graph():
    times = {1: 4.4, 2: 4.4, 4: 4.5, 448: 20.8, 480: 18.1, 512: 18.2, 544: 19.0}
    assert fastest_routes(times) == {448: 480}
    assert fastest_routes({1: 1.0, 2: 0.99}) == {}  # within the timing margin
    assert fastest_routes({8: 3.0, 16: 2.0, 24: 1.0}) == {8: 24, 16: 24}
    assert fastest_routes({8: 1.0, 16: 0.5, 24: 0.5}) == {8: 16}  # of equal times, the smaller graph


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


def test_the_eager_warm_up_fills_the_first_blocks_and_leaves_outputs_as_they_were(monkeypatch):
    # `ModelRunner.warm_up_eager` runs the largest step once at start-up (on CUDA; forced here) with its own batch,
    # writing KV into the first blocks of the real pool: what serves requests afterwards must not notice
    kw = dict(model="dummy:tiny", device="cpu", num_kv_blocks=64, max_num_batched_tokens=256, max_model_len=512)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], list(range(40, 61)), [7] * 3]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    monkeypatch.setenv("SLUICE_EAGER_WARMUP", "0")
    with LLM(**kw) as llm:
        assert not any(bool(c.any()) for c in llm.engine.local_core.executor.runner.kv_caches)
        cold = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("SLUICE_EAGER_WARMUP", "1")
    with LLM(**kw) as llm:
        runner = llm.engine.local_core.executor.runner
        blocks = runner._largest_step_blocks()
        assert blocks == 256 // runner.block_size
        assert all(bool(c[:, :blocks].flatten(2).any(2).all()) for c in runner.kv_caches)  # K and V of each block
        assert not any(bool(c[:, blocks:].any()) for c in runner.kv_caches)
        warm = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert warm == cold


def test_a_runner_is_freed_as_soon_as_its_last_reference_goes():
    """A runner in no reference cycle: its model and KV pool go with the last reference, whenever the collector
    runs. Benchmarks build engines one after another; a runner in a cycle (a closure over it in its grammar
    rows) outlived a collection that came while a worker thread still held it, and the next engine loaded
    beside it (`test_each_engine_is_freed_before_the_next_is_built`, which catches it only by timing)."""
    import gc
    import weakref

    from sluice.core.args import EngineArgs
    from sluice.core.models.loader import resolve_model
    from sluice.core.sampling_params import StructuredOutputsParams
    from sluice.core.worker.model_runner import ModelRunner

    runner = ModelRunner(EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=8), resolve_model("dummy:tiny"), 64)
    # a step of a plain and a constrained request: the grammar backend and its compile thread come into play
    plain = SamplingParams(temperature=0)
    constrained = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    so = step_of([("a", list(range(100, 110)), 0, 10, [1], True), ("b", list(range(200, 210)), 0, 10, [2], True)])
    so.new_requests[1].sampling_params = constrained
    assert so.new_requests[0].sampling_params == plain
    assert len(runner.execute(so).token_ids) == 2
    assert runner.grammar.rows_filled == 1  # b's row was masked
    runner.execute(SchedulerOutput(2, finished_request_ids=["a", "b"]))
    tensors = [weakref.ref(t) for t in (*runner.model.parameters(), *runner.kv_caches)]
    gc.collect()
    gc.disable()
    try:
        del runner
        alive = sum(t() is not None for t in tensors)
    finally:
        gc.enable()
    assert alive == 0
