"""Structured outputs enforced token by token (`core/structured/`), on random weights (`dummy:tiny`): held-out
schema families give schema-valid JSON for many seeds and with n > 1; regex and choice; speculation on and off
give equal output at T=0 under a grammar; a request cancelled mid-stream frees its blocks and its matcher; a row
whose grammar dies fails its request alone; rows without a grammar cost nothing."""

from __future__ import annotations

import json
import re

import anyio
import jsonschema
import pytest
import torch
from sluice.core import LLM, AsyncEngine, EngineArgs, SamplingParams, StructuredOutputsParams
from sluice.core.errors import InvalidStructuredOutput, RequestFailedError

from tests.spec_helpers import copy_head_dir
from tests.structured_schemas import SCHEMAS

MODEL = "dummy:tiny"
COMMON = dict(device="cpu", num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def llm():
    engine = LLM(MODEL, seed=0, **COMMON)
    yield engine
    engine.close()


def _json(schema, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 200)
    kw.setdefault("temperature", 1.0)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), **kw)


def _runner(llm: LLM):
    return llm.engine.local_core.executor.runner


def test_schema_families_give_valid_json_for_many_seeds_and_n(llm):
    prompts, params, names = [], [], []
    for name, schema in SCHEMAS.items():
        for seed in range(4):
            prompts.append(f"{name} {seed}")
            params.append(_json(schema, seed=seed))
            names.append(name)
        prompts.append(f"{name} n")
        params.append(_json(schema, n=3))  # unseeded siblings: each its own matcher
        names.append(name)
    outs = llm.generate(prompts, params, use_tqdm=False)
    texts = set()
    for name, out in zip(names, outs):
        for seq in out.outputs:
            assert seq.finish_reason == "stop", (name, seq.text)
            jsonschema.validate(json.loads(seq.text), SCHEMAS[name])
            texts.add(seq.text)
    assert len(texts) > len(SCHEMAS) * 3  # the seeds and the siblings sample different documents
    # finished requests leave the executor's batch, matchers included, with the next step
    llm.generate(["next"], SamplingParams(max_tokens=1), use_tqdm=False)
    assert not _runner(llm).grammar.matchers and not _runner(llm).grammar.families


def test_json_is_compact_unless_whitespace_flexible(llm):
    schema = SCHEMAS["nested_object"]
    out = llm.generate(["x"], _json(schema, seed=1), use_tqdm=False)[0].outputs[0].text
    assert out == json.dumps(json.loads(out), separators=(",", ":"), ensure_ascii=False)


def test_json_object_regex_and_choice(llm):
    specs = [
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"),
        StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
    ]
    params = [
        SamplingParams(max_tokens=100, temperature=1.0, seed=s, structured_outputs=so) for so in specs for s in (1, 2)
    ]
    seqs = [o.outputs[0] for o in llm.generate(["q"] * len(params), params, use_tqdm=False)]
    outs = [s.text for s in seqs]
    # any object: unbounded, random weights may run out of tokens first (then a prefix of one)
    assert all(t.startswith("{") for t in outs[:2])
    assert all(isinstance(json.loads(s.text), dict) for s in seqs[:2] if s.finish_reason == "stop")
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", t) for t in outs[2:4])
    assert all(t in ("yes", "no", "maybe so") for t in outs[4:])


def test_unconstrained_rows_cost_nothing(llm):
    rows = _runner(llm).grammar
    before = rows.rows_filled
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert rows.rows_filled == before


def test_a_constrained_batch_beside_free_rows_masks_only_its_own(llm):
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    schema = SCHEMAS["enum"]
    alone = llm.generate(["p", "q"], free, use_tqdm=False)
    mixed = llm.generate(["p", "c", "q"], [free, _json(schema, seed=3), free], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids]
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), schema)


def test_invalid_schema_is_refused_before_the_engine(llm):
    with pytest.raises(InvalidStructuredOutput):
        llm.generate(["x"], _json({"type": "strng"}), use_tqdm=False)


def test_a_dead_grammar_fails_its_request_alone():
    """A matcher that allows no token (a grammar gone wrong) ends its request with an error; the request beside
    it in the same steps, constrained too, finishes normally."""

    class Dead:
        def __init__(self, m):
            self.m = m

        def __getattr__(self, name):
            return getattr(self.m, name)

        def fill_bitmask(self, bitmask, row):
            bitmask[row] = 0

    def dying(real):
        def matcher(grammar):
            m = real(grammar)
            return Dead(m) if "dead" in grammar.source else m

        return matcher

    dead = SamplingParams(max_tokens=50, structured_outputs=StructuredOutputsParams(regex="dead|alive"))
    ok = _json(SCHEMAS["ref"], seed=4)

    async def run():
        async with AsyncEngine(EngineArgs(MODEL, seed=0, **COMMON)) as engine:
            backend = engine.local_core.executor.runner.grammar.backend
            backend.matcher = dying(backend.matcher)
            # each row through its own matcher's fill (the batched fill reads llguidance's matchers directly)
            backend.fill_bitmasks = lambda rows, bitmask: [m.fill_bitmask(bitmask, i) for m, i in rows]
            results = {}

            async def one(name, params):
                try:
                    async for out in engine.generate("p", params, final_only=True):
                        results[name] = out.text
                except RequestFailedError as e:
                    results[name] = e

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "dead", dead)
                tg.start_soon(one, "ok", ok)
            await _one_more_step(engine)
            stats = engine.stats()
            grammar = engine.local_core.executor.runner.grammar
            return results, stats, dict(grammar.matchers)

    results, stats, left = anyio.run(run)
    assert isinstance(results["dead"], RequestFailedError) and "no token" in str(results["dead"])
    jsonschema.validate(json.loads(results["ok"]), SCHEMAS["ref"])
    assert stats.kv_blocks_free == stats.kv_blocks_total and not left


async def _one_more_step(engine: AsyncEngine) -> None:
    """Ended requests leave the executor's batch (matchers included) with the next step: run one."""
    async for _ in engine.generate("q", SamplingParams(max_tokens=2, temperature=0)):
        pass


def test_cancelled_mid_stream_frees_blocks_and_matcher():
    schema = {"type": "array", "items": {"type": "string"}, "minItems": 400}  # long: cancelled before its end

    async def run():
        async with AsyncEngine(EngineArgs(MODEL, seed=0, **COMMON)) as engine:
            runner = engine.local_core.executor.runner
            seen = 0
            async for _ in engine.generate("p", _json(schema, max_tokens=400, seed=5)):
                seen += 1
                if seen == 1:
                    assert len(runner.grammar.matchers) == 1
                if seen == 5:
                    break
            await _one_more_step(engine)
            stats = engine.stats()
            return seen, stats, dict(runner.grammar.matchers)

    seen, stats, left = anyio.run(run)
    assert seen == 5 and not left
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == 0


def test_speculation_on_and_off_agree_under_a_grammar(tmp_path):
    """A draft head that copies its input token proposes drafts the grammar often rejects (a repeated ``{"``) and
    sometimes accepts (inside strings): verification rows are masked after the drafts before them, so greedy
    output equals plain constrained decoding."""
    from sluice.core.models.loader import resolve_model

    head = copy_head_dir(tmp_path, MODEL, resolve_model(MODEL).config)
    plain = LLM(MODEL, seed=0, **COMMON)
    spec = LLM(MODEL, seed=0, speculative_model=head, num_speculative_tokens=3, **COMMON)
    try:
        for e in (plain, spec):  # rougher random weights: greedy text that varies
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in e.engine.local_core.executor.runner.model.parameters():
                    if p.dim() == 2:
                        p.normal_(0.0, 0.1, generator=g)
        names = ["nested_object", "bounded_array", "any_of_one_of", "pattern_nullable_ranges"]
        prompts = [f"prompt {i} {n}" for i, n in enumerate(names)]
        params = [_json(SCHEMAS[n], temperature=0, max_tokens=60) for n in names]
        params.append(SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))  # a free row beside them
        prompts.append("free")
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
        assert got == want
        solo = [spec.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids for p, q in zip(prompts[:2], params)]
        assert solo == want[:2]
        assert spec.engine.stats().spec_num_draft_tokens > 0
        for name, out in zip(names, want):
            text = plain.engine.tokenizer.decode(out, skip_special_tokens=True)
            if len(out) < 60:
                jsonschema.validate(json.loads(text), SCHEMAS[name])
    finally:
        plain.close()
        spec.close()


def test_preempted_requests_resume_their_grammar():
    """A pool too small for the batch: constrained requests are preempted and recomputed; each matcher comes back
    caught up with the tokens its request had, so the output equals a run without preemption."""
    names = list(SCHEMAS)
    # EOS ignored: after its document a request goes on (the grammar allows only the end), so the batch outgrows
    # the pool
    params = [_json(SCHEMAS[n], temperature=0.8, seed=i, max_tokens=48, ignore_eos=True) for i, n in enumerate(names)]
    prompts = [f"{'a long prompt ' * (8 + i)} {n}" for i, n in enumerate(names)]
    runs, preemptions = [], 0
    for blocks in (256, 20):
        llm = LLM(MODEL, seed=0, **{**COMMON, "num_kv_blocks": blocks, "block_size": 16})
        try:
            runs.append([o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)])
            preemptions = llm.engine.stats().num_preemptions
        finally:
            llm.close()
    assert preemptions > 0
    assert runs[0] == runs[1]
    for name, text in zip(names, runs[1]):
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_the_inspector_marks_constrained_rows():
    llm = LLM(MODEL, seed=0, enable_inspector=True, **COMMON)
    try:
        free = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        llm.generate(["free", "json"], [free, _json(SCHEMAS["ref"], seed=1)], use_tqdm=False)
        rows = [(r.request_id, r.constrained) for rec in llm.engine.inspector.steps for r in rec.requests]
    finally:
        llm.close()
    marked = {rid for rid, c in rows if c}
    assert len(marked) == 1 and {rid for rid, _ in rows} - marked  # the constrained one only
