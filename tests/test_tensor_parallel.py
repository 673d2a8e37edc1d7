"""Tensor parallelism on the CPU: two gloo ranks in two worker processes give the greedy tokens of one
process; a worker that dies fails the request in flight and leaves the engine dead, not hanging.

The tiny checkpoints cover both head layouts: a Llama with 8 KV heads (an even split, 4 per rank) and a
Qwen2 with 9 query heads over 3 KV heads, an odd MLP width and an odd vocabulary (uneven splits
everywhere, KV head 1 on both ranks, padding query slots). The real default model (9 / 3 heads too) is
the slow test. Every engine's workers must be gone when it closes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from sluice.core import LLM, AsyncEngine, EngineArgs, SamplingParams
from sluice.core.errors import EngineDeadError, InvalidRequestError, ModelLoadError, WorkerDiedError
from sluice.core.models.parallel import plan_heads, shard_range

from tests.helpers import prompt_of_length, save_tiny_hf_model, tiny_hf_config

NEW_TOKENS = 24
PROMPT_LENS = [1, 17, 40]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
ENGINE = dict(device="cpu", num_kv_blocks=64, block_size=16, max_model_len=256)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _assert_stopped(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), f"worker processes left running: {[p for p in pids if not _gone(p)]}"


# ------------------------------------------------------------------------------------------- planning


def test_shard_ranges_are_contiguous_and_balanced():
    for n in (1, 5, 9, 49151, 49152):
        for world in range(1, 6):
            if world > n:
                continue
            ranges = [shard_range(n, r, world) for r in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            sizes = [e - s for s, e in ranges]
            assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(
    "heads,kv,world", [(9, 3, 2), (9, 3, 3), (32, 8, 2), (32, 8, 4), (32, 8, 16), (8, 2, 4), (16, 8, 2), (12, 4, 5)]
)
def test_head_plans_cover_every_head_once_with_a_uniform_group(heads, kv, world):
    group = heads // kv
    seen = []
    for r in range(world):
        plan = plan_heads(heads, kv, r, world)
        per = len(plan.q_heads) // len(plan.kv_heads)
        assert per * len(plan.kv_heads) == len(plan.q_heads)
        for slot, h in enumerate(plan.q_heads):
            if h >= 0:  # the backend pairs slot j with local KV head j // per: it must be the head's own
                assert plan.kv_heads[slot // per] == h // group
                seen.append(h)
    assert sorted(seen) == list(range(heads))
    if heads % world == 0 and (kv % world == 0 or (world % kv == 0 and group % (world // kv) == 0)):
        assert all(plan_heads(heads, kv, r, world).num_padding == 0 for r in range(world))


def test_default_model_heads_replicate_a_kv_head_over_two_ranks():
    """9 query heads over 3 KV heads on 2 ranks: an uneven split, and KV head 1 is on both ranks."""
    a, b = plan_heads(9, 3, 0, 2), plan_heads(9, 3, 1, 2)
    assert set(a.kv_heads) & set(b.kv_heads) == {1}
    assert a.num_padding + b.num_padding > 0
    with pytest.raises(ModelLoadError, match="exceeds"):
        plan_heads(4, 2, 0, 8)


def test_engine_args_validate_tensor_parallel_fields():
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size"):
        EngineArgs(tensor_parallel_size=0)
    with pytest.raises(InvalidRequestError, match="tensor_parallel_local_size"):
        EngineArgs(tensor_parallel_size=2, tensor_parallel_local_size=3)
    with pytest.raises(InvalidRequestError, match="speculative_model"):
        EngineArgs(tensor_parallel_size=2, speculative_model="default")
    from sluice.app.commands.cli import build_parser, engine_args_from

    ns = build_parser().parse_args(["generate", "--prompt", "x", "--tensor-parallel-size", "2"])
    assert engine_args_from(ns).tensor_parallel_size == 2


def test_too_many_ranks_for_the_heads_is_refused_before_any_process_starts():
    with pytest.raises(InvalidRequestError, match="exceeds the model's 4 attention heads"):
        LLM(model="dummy:tiny", tensor_parallel_size=8, **ENGINE)


def test_remote_ranks_need_the_rendezvous_variables(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(InvalidRequestError, match="MASTER_ADDR"):
        LLM(model="dummy:tiny", tensor_parallel_size=2, tensor_parallel_local_size=1, **ENGINE)


# ------------------------------------------------------------------------- greedy parity, tiny models


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, default_tokenizer):
    vocab = len(default_tokenizer)
    configs = {
        "llama-8kv": tiny_hf_config("llama", vocab, num_attention_heads=16, num_key_value_heads=8),
        "qwen2-9q3kv": tiny_hf_config(
            "qwen2", vocab - 1, num_attention_heads=9, num_key_value_heads=3, intermediate_size=99
        ),
    }
    out = {}
    for i, (name, cfg) in enumerate(configs.items()):
        d = tmp_path_factory.mktemp(name)
        save_tiny_hf_model(cfg, d, default_tokenizer, seed=10 + i)
        out[name] = str(d)
    return out


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    return [prompt_of_length(default_tokenizer, n, f"Note {n}:") for n in PROMPT_LENS]


def test_each_rank_loads_only_its_shard(tiny_dirs):
    """Rank models built in this process (loading needs no collective): their shards put back together
    are the checkpoint, padding slots are zero, and each rank's KV heads are the ones its plan names."""
    import torch
    from sluice.core.models.loader import iter_safetensors, load_model, resolve_model
    from sluice.core.models.parallel import TensorParallel

    source = resolve_model(tiny_dirs["qwen2-9q3kv"])
    cfg = source.config
    full = dict(iter_safetensors(source.weights_dir))
    ranks = [load_model(source, torch.float32, torch.device("cpu"), 64, tp=TensorParallel(r, 2)) for r in range(2)]
    d = cfg.head_dim
    embeds = [m.model.embed_tokens.weight for m in ranks]
    assert sum(e.shape[0] for e in embeds) == cfg.vocab_size and embeds[0].shape[0] != embeds[1].shape[0]
    assert torch.equal(torch.cat(embeds), full["model.embed_tokens.weight"])
    downs = [m.model.layers[1].mlp.down_proj.weight for m in ranks]
    assert torch.equal(torch.cat(downs, dim=1), full["model.layers.1.mlp.down_proj.weight"])
    q_full = full["model.layers.1.self_attn.q_proj.weight"].view(cfg.num_attention_heads, d, -1)
    k_full = full["model.layers.1.self_attn.k_proj.weight"].view(cfg.num_key_value_heads, d, -1)
    o_full = full["model.layers.1.self_attn.o_proj.weight"].view(cfg.hidden_size, cfg.num_attention_heads, d)
    for m in ranks:
        attn = m.model.layers[1].self_attn
        plan = attn.heads
        assert m.num_kv_heads == len(plan.kv_heads) == 2  # the KV pool holds this rank's heads
        q, k, _ = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
        q, o = q.view(len(plan.q_heads), d, -1), attn.o_proj.weight.view(cfg.hidden_size, -1, d)
        for slot, h in enumerate(plan.q_heads):
            assert torch.equal(q[slot], q_full[h] if h >= 0 else torch.zeros_like(q[slot]))
            assert torch.equal(o[:, slot], o_full[:, h] if h >= 0 else torch.zeros_like(o[:, slot]))
        assert torch.equal(k.view(-1, d, k.shape[-1]), k_full[list(plan.kv_heads)])


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    solo = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:1]]
    return solo + [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("name", ["llama-8kv", "qwen2-9q3kv"])
def test_two_ranks_give_the_tokens_of_one(name, tiny_dirs, prompts):
    with LLM(model=tiny_dirs[name], **ENGINE) as one:
        ref = _greedy(one, prompts)
    two = LLM(model=tiny_dirs[name], tensor_parallel_size=2, **ENGINE)
    pids = two.engine.local_core.executor.runner.worker_pids
    try:
        assert len(pids) == 2 and os.getpid() not in pids
        assert _greedy(two, prompts) == ref
        assert two.engine.is_healthy
    finally:
        two.close()
    _assert_stopped(pids)
    assert len({t for r in ref for t in r}) > 10  # not a degenerate repetition


def test_a_rank_from_another_host_joins_through_the_rendezvous(tiny_dirs, prompts, monkeypatch):
    """Rank 1 started like a rank on a second host (`python -m sluice.core.worker.tp.worker` with the torchrun
    variables); the engine runs only rank 0. Here both are on one host, over loopback."""
    from sluice.core.worker.tp.distributed import free_port

    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK="1")
    env.update(LOCAL_RANK="0", SLUICE_TP_DEVICE="cpu")
    remote = subprocess.Popen(
        [sys.executable, "-m", "sluice.core.worker.tp.worker"], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        name = "llama-8kv"
        with LLM(model=tiny_dirs[name], tensor_parallel_size=2, tensor_parallel_local_size=1, **ENGINE) as two:
            assert len(two.engine.local_core.executor.runner.worker_pids) == 1
            got = [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY, use_tqdm=False)]
        assert remote.wait(timeout=30) == 0, remote.stderr.read()[-2000:]
    finally:
        if remote.poll() is None:
            remote.kill()
            remote.wait()
    with LLM(model=tiny_dirs[name], **ENGINE) as one:
        assert got == [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]


# ---------------------------------------------------------------------------------- a worker dies


async def test_a_killed_worker_fails_the_request_in_flight_and_the_engine():
    import httpx
    from sluice.app.server.app import build_app

    args = EngineArgs(model="dummy:tiny", tensor_parallel_size=2, **ENGINE)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    async with AsyncEngine(args) as engine:
        pids = engine.local_core.executor.runner.worker_pids
        got = 0
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"worker rank 1 \(pid \d+\) died: killed by SIGKILL") as err:
            async for out in engine.generate([5, 6, 7], long):
                if got == 0 and out.delta_token_ids:
                    os.kill(pids[1], signal.SIGKILL)
                got += len(out.delta_token_ids)
        assert time.monotonic() - t0 < 30  # failed, not hung until a timeout
        assert 0 < got < 200
        assert isinstance(engine.local_core.executor.failure, WorkerDiedError)
        assert not engine.is_healthy and not engine.stats().healthy
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine)), base_url="http://t") as c:
            assert (await c.get("/health")).status_code == 503
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate([5, 6, 7], long):
                pass
        assert "rank 1" in str(err.value)
    _assert_stopped(pids)


async def test_a_worker_that_dies_between_steps_makes_the_engine_unhealthy():
    args = EngineArgs(model="dummy:tiny", tensor_parallel_size=2, **ENGINE)
    async with AsyncEngine(args) as engine:
        pids = engine.local_core.executor.runner.worker_pids
        async for _ in engine.generate([5, 6, 7], SamplingParams(max_tokens=2)):
            pass
        assert engine.is_healthy
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while engine.is_healthy and time.monotonic() < deadline:
            await __import__("anyio").sleep(0.05)
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError, match="rank 0"):
            async for _ in engine.generate([5, 6, 7], SamplingParams(max_tokens=2)):
                pass
    _assert_stopped(pids)


# ------------------------------------------------------------------------------------------ benchmark


def test_throughput_compares_tensor_parallel_sizes_in_one_run(tmp_path, capsys):
    import json

    from sluice.app.commands.cli import main as sluice

    out = tmp_path / "tp.json"
    argv = ["bench", "throughput", "--model", "dummy:tiny", "--device", "cpu", "--dataset", "random"]
    argv += ["--num-prompts", "4", "--input-len", "12", "--output-len", "6", "--num-kv-blocks", "64"]
    assert sluice([*argv, "--compare-tp", "1,2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    by_tp = r["tensor_parallel"]
    assert sorted(by_tp) == ["1", "2"]
    for tp, f in by_tp.items():
        assert f["exact_output_lens"] == 4 and f["output_tokens"] == 24
        assert f["engine"]["tensor_parallel_size"] == int(tp)
    assert r["ratio_tp"] == pytest.approx(by_tp["2"]["output_tokens_per_s"] / by_tp["1"]["output_tokens_per_s"])
    assert "output tok/s, TP=2 / TP=1" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ the real model


@pytest.mark.slow
def test_default_model_two_ranks_give_the_tokens_of_one(default_llm, default_tokenizer):
    """The default model's 9 query heads over 3 KV heads: KV head 1 on both ranks (fp32, gloo)."""
    from sluice.core.frontend.tokenizer import apply_chat_template

    ps = [prompt_of_length(default_tokenizer, n, f"Story {n}:") for n in (7, 33)]
    ps.append(apply_chat_template(default_tokenizer, [{"role": "user", "content": "Name three rivers."}]))
    ref = [o.outputs[0].token_ids for o in default_llm.generate(ps, GREEDY, use_tqdm=False)]
    two = LLM(model="smollm2-135m-instruct", device="cpu", tensor_parallel_size=2, num_kv_blocks=64, max_model_len=512)
    pids = two.engine.local_core.executor.runner.worker_pids
    try:
        assert [o.outputs[0].token_ids for o in two.generate(ps, GREEDY, use_tqdm=False)] == ref
    finally:
        two.close()
    _assert_stopped(pids)
