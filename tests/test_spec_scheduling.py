"""The scheduler's bookkeeping of speculative steps fed from the device, against a simulated device.

A fake executor holds each request's true token sequence (what the device has computed and sampled, including
tokens the scheduler has not been told of yet), verifies drafts greedily against a deterministic "target"
and drafts with a "draft head" that is wrong now and then. The loop drives the real `Scheduler` and
`KVCacheManager` the way `SchedulerActor` does (a second step scheduled while one is in flight, when
`needs_sync` allows). The device side checks what the GPU path relies on: a row fed from the device starts,
once moved by the accepted count of the step before it, exactly at its request's last token, and its table
covers every slot it may write. The outputs must equal plain greedy decoding, and every block comes back."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest
from sluice.core.request import Request
from sluice.core.sampling_params import SamplingParams
from sluice.core.sched.scheduler import Scheduler, SchedulerConfig
from sluice.core.step import ModelOutput, SchedulerOutput
from sluice.kv.manager import KVCacheManager

K = 3
STOP = 13


def target(seq: list[int]) -> int:
    return (seq[-1] * 7 + seq[-2] * 3 + len(seq)) % 40 + 10


def draft(seq: list[int]) -> int:
    return target(seq) if (len(seq) * 5 + seq[-1]) % 4 else 9  # 9: a token the target never emits


@dataclass
class DeviceState:
    tokens: list[int]  # every token the device knows: prompt, then each emitted one
    drafts: list[int] = field(default_factory=list)  # proposed by the last step that drafted
    accepted: int = 0  # drafts the last uniform step accepted
    uniform: bool = False  # the last step that computed this request was a uniform one


class FakeDevice:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.state: dict[str, DeviceState] = {}
        self.fed_rows = 0

    def run(self, so: SchedulerOutput) -> ModelOutput:
        for nr in so.new_requests:
            self.state[nr.request_id] = DeviceState(list(nr.token_ids))
        out = ModelOutput(so.step_id, spec_token_ids={}, draft_token_ids={})
        bs = self.kv.block_size
        for rid, n, start, sample in zip(so.req_ids, so.num_scheduled_tokens, so.num_computed_tokens, so.samples):
            st = self.state[rid]
            d = so.num_draft_tokens.get(rid, 0)
            if so.uniform:
                assert d == K and n == K + 1 and sample and rid in so.drafting
            if rid in so.device_fed:
                assert so.uniform and st.uniform, "fed from a step that left no state on the device"
                start += st.accepted
                drafts = st.drafts
            else:
                drafts = st.drafts[:d]
            last = start + n - d - 1  # the position of the last known token
            assert last == len(st.tokens) - 1 if sample else last < len(st.tokens) - 1, (rid, start, n, d)
            # KV slots written: the row's, then the next drafts' (a row that samples and drafts)
            reach = start + n + (K - 1 if rid in so.drafting and sample else 0)
            assert len(self.kv.req_block_ids[rid]) * bs >= reach, (rid, reach)
            st.uniform = so.uniform
            if not sample:
                continue
            emitted: list[int] = []
            for j in range(d + 1):  # greedy verification: the target's own tokens, up to the first miss
                emitted.append(target(st.tokens + emitted))
                if j == d or drafts[j] != emitted[-1]:
                    break
            st.tokens += emitted
            st.accepted = len(emitted) - 1
            out.req_ids.append(rid)
            out.token_ids.append(emitted[-1])
            if d:
                out.spec_token_ids[rid] = emitted
            if rid in so.drafting:
                st.drafts = []
                for _ in range(K):
                    st.drafts.append(draft(st.tokens + st.drafts))
                out.draft_token_ids[rid] = list(st.drafts)
        self.fed_rows += len(so.device_fed)
        return out


def _reference(prompt: list[int], max_tokens: int, stops: bool) -> list[int]:
    """Plain greedy decoding of the target."""
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        t = target(seq)
        seq.append(t)
        out.append(t)
        if stops and t == STOP:
            break
    return out


@pytest.mark.parametrize(
    "num_blocks, disable, num_requests, spread",
    [
        (400, 16, 16, 40),  # room for all, requests arriving while others decode
        (400, 3, 16, 40),  # the load switch turning speculation off and on
        (20, 16, 5, 0),  # a pool short enough to preempt
    ],
)
def test_steps_fed_from_the_device_keep_the_books(num_blocks: int, disable: int, num_requests: int, spread: int):
    kv = KVCacheManager(num_blocks, 4)
    config = SchedulerConfig(
        max_num_seqs=6,
        max_num_batched_tokens=64,
        max_model_len=200,
        max_waiting_requests=100,
        num_speculative_tokens=K,
        speculative_disable_batch_size=disable,
        async_scheduling=True,
        max_uniform_batch=4,
    )
    sched = Scheduler(config, kv)
    device = FakeDevice(kv)
    rng = random.Random(num_blocks + disable)
    expected: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    arrivals = deque()
    for i in range(num_requests):
        prompt = [rng.randrange(10, 50) for _ in range(rng.randrange(2, 30))]
        max_tokens = rng.randrange(1, 60)
        stop = [STOP] if i % 3 == 0 else []
        expected[f"r{i}"] = _reference(prompt, max_tokens, stops=bool(stop))
        params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=stop, ignore_eos=True)
        arrivals.append((rng.randrange(0, spread + 1), Request(f"r{i}", prompt, params, max_tokens)))
    arrivals = deque(sorted(arrivals, key=lambda a: a[0]))
    inflight: deque[tuple[SchedulerOutput, ModelOutput]] = deque()
    finished: set[str] = set()
    loop = 0
    while arrivals or sched.has_work() or inflight:
        loop += 1
        assert loop < 5000
        while arrivals and arrivals[0][0] <= loop:  # requests arrive while steps run
            sched.add_request(arrivals.popleft()[1])
        if sched.has_work() and (not inflight or (len(inflight) < 2 and not sched.needs_sync())):
            so = sched.schedule()
            if so.req_ids:
                sync = not inflight and sched.needs_sync()
                inflight.append((so, device.run(so)))
                if not sync and len(inflight) < 2:
                    continue
            elif not inflight:
                continue
        if inflight:
            so, out = inflight.popleft()
            for ev in sched.update_from_output(so, out):
                got.setdefault(ev.request_id, []).extend(ev.token_ids)
                if ev.finish_reason is not None:
                    finished.add(ev.request_id)
    assert finished == set(expected)
    assert got == expected
    assert kv.num_free_blocks == num_blocks
    assert sched.spec_stats.num_drafts > 0
    if disable == 16:  # below the switch the steady state is fed from the device
        assert device.fed_rows > 0
    if num_blocks < 100:
        assert sched.num_preemptions > 0
