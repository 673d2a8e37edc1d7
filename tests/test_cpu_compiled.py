"""The CPU's compiled decode step (`core/worker/cpu_compiled.py`): the same tokens as the eager step from the one
graph over batches of 4 down to 1 and contexts of 1 to 5 blocks (the graph keeps no guards: a call outside what it
was compiled for would not recompile, it would compute wrong tokens), and a failed compile leaves the engine eager.
The second case compiles another model's graph in the process that compiled the first's: each engine must run
its own (a shared guard-free graph fails on the other model's missing weights)."""

from __future__ import annotations

import pytest
from sluice.core import LLM, SamplingParams
from sluice.core.worker.cpu_compiled import CompiledDecode

# lengths across block boundaries (block 16): contexts of 1 to 5 blocks over the run
PROMPTS = [[5 + i for i in range(n)] for n in (3, 17, 33, 40)]


def _generate(max_tokens: list[int], **kw):
    llm = LLM(model="dummy:tiny", device="cpu", seed=0, num_kv_blocks=64, **kw)
    try:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for n in max_tokens]
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [o.outputs[0] for o in outs], llm.engine.local_core.executor.runner.graphs
    finally:
        llm.close()


@pytest.mark.parametrize(
    "options", [{}, {"dtype": "bfloat16", "quantization": "int4"}], ids=["fp32", "bf16-int4-packed"]
)
def test_compiled_decode_gives_the_eager_tokens(options):
    max_tokens = [40, 24, 9, 31]  # rows finish at different steps: batches of 4, 3, 2 and 1
    eager, none = _generate(max_tokens, **options)
    compiled, graphs = _generate(max_tokens, cpu_compile=True, **options)
    assert none is None and isinstance(graphs, CompiledDecode)
    assert graphs.num_replays >= max(max_tokens) // 2  # the decode steps ran compiled
    for e, c in zip(eager, compiled):
        first = next((i for i, (a, b) in enumerate(zip(e.token_ids, c.token_ids)) if a != b), None)
        if first is None:
            assert list(e.token_ids) == list(c.token_ids)
            continue
        # fp32 reorders sums only; bf16 rounds its fused elementwise work once where eager rounds each op: a
        # token may differ only where the eager step itself was undecided between its top two
        assert options, f"fp32: compiled and eager diverged at token {first}"
        top2 = sorted((lp.logprob for lp in e.logprobs[first].values()), reverse=True)[:2]
        assert top2[0] - top2[1] < 0.05, f"diverged at token {first} with a margin of {top2[0] - top2[1]:.3f}"


def test_a_failed_compile_leaves_every_step_eager(monkeypatch):
    def broken(self):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(CompiledDecode, "capture", broken)
    outs, graphs = _generate([6, 6, 6, 6], cpu_compile=True)
    assert graphs is None
    assert all(len(o.token_ids) == 6 for o in outs)
