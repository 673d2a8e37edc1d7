"""The sampler's per-row inputs, built from the persistent batch: `SamplingBatchBuilder` (one builder for every
step, plain and speculative, and the memory profile) and `SeededGenerators` (the per-request random streams of
seeded requests)."""

from __future__ import annotations

import numpy as np
import torch
from sluice.core.worker.input_batch import InputBatch
from sluice.core.worker.sampler import SamplingBatch
from sluice.core.worker.step_buffers import StepBuffers


class SeededGenerators:
    """One `torch.Generator` per seeded request, created at its first sampled token and kept until the request
    is dropped for good (a preempted request's stream goes on where it stopped)."""

    def __init__(self, batch: InputBatch, device: torch.device, vocab_size: int, skip_prefill_draws: bool) -> None:
        self.batch = batch
        self.device = device
        self.vocab_size = vocab_size
        self.skip_prefill_draws = skip_prefill_draws  # a decode engine of a prefill/decode pair (core/disagg/)
        self.by_request: dict[str, torch.Generator] = {}

    def of_slot(self, slot: int) -> torch.Generator:
        rid = self.batch.req_ids[slot]
        g = self.by_request.get(rid)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(self.batch.params[slot].seed)
            self.by_request[rid] = g
            if self.skip_prefill_draws:
                self._skip_prefill_draws(g, slot)
        return g

    def drop(self, req_id: str) -> None:
        self.by_request.pop(req_id, None)

    def _skip_prefill_draws(self, g: torch.Generator, slot: int) -> None:
        """A decode engine's request arrives with the first token the prefill engine sampled (one draw of the
        same seed's stream there). Drawing it here too, and dropping it, keeps the stream where one engine's
        would be: seeded sampling gives the same tokens through the pair as through one engine."""
        for _ in range(int(self.batch.num_arrived[slot] - self.batch.num_prompt[slot])):
            torch.empty(self.vocab_size, device=self.device).exponential_(generator=g)


class SamplingBatchBuilder:
    def __init__(self, batch: InputBatch, generators: SeededGenerators, device: torch.device) -> None:
        self.batch = batch
        self.generators = generators
        self.device = device

    def build(
        self,
        slots: np.ndarray,
        num_outputs: np.ndarray,
        b: StepBuffers,
        extra_outputs: list[list[int]] | None = None,
    ) -> SamplingBatch | None:
        """The sampler's per-row parameters, or None when plain argmax serves every row. Row ``i`` belongs to
        slot ``slots[i]`` and samples after ``num_outputs[i]`` output tokens: its own so far, then (a
        verification row) ``extra_outputs[i]``, the drafts before it."""
        ib = self.batch
        k = len(slots)
        temperature = ib.temperature[slots]
        any_pen = bool(ib.penalized[slots].any())
        early = num_outputs < ib.min_tokens[slots]
        any_banned = bool(early.any())
        nlp = int(ib.num_logprobs[slots].max()) if k else -1
        all_greedy = not temperature.any()
        if all_greedy and not any_pen and not any_banned and nlp < 0:
            return None
        if k > b.max_seqs:
            b = StepBuffers(1, k, 1, self.device)
        f = b.sampling_f_np
        f[0, :k] = temperature
        f[1, :k] = ib.top_p[slots]
        f[2, :k] = ib.min_p[slots]
        if any_pen:
            f[3, :k] = ib.presence[slots]
            f[4, :k] = ib.frequency[slots]
            f[5, :k] = ib.repetition[slots]
        top_k = ib.top_k[slots]
        b.top_k_np[:k] = top_k
        b.upload_sampling(k, any_pen)
        slot_list = slots.tolist()
        seeded = ib.seeded[slots]
        of_slot = self.generators.of_slot
        generators = [of_slot(s) if g else None for s, g in zip(slot_list, seeded)]
        banned = None
        if any_banned:
            banned = [
                list(ib.eos[s]) + list(ib.params[s].stop_token_ids) if e else [] for s, e in zip(slot_list, early)
            ]
        outputs = prompts = None
        if any_pen:
            outputs = []
            for i, s in enumerate(slot_list):
                out = ib.output_tokens[s] or []
                outputs.append(out + extra_outputs[i] if extra_outputs is not None else out)
            prompts = [ib.tokens[s][: ib.num_prompt[s]] if ib.penalized[s] else [] for s in slot_list]
        dev = b.sampling_f
        return SamplingBatch(
            temperature=dev[0, :k],
            top_k=b.top_k[:k],
            top_p=dev[1, :k],
            min_p=dev[2, :k],
            generators=generators,
            presence_penalty=dev[3, :k] if any_pen else None,
            frequency_penalty=dev[4, :k] if any_pen else None,
            repetition_penalty=dev[5, :k] if any_pen else None,
            output_token_ids=outputs,
            prompt_token_ids=prompts,
            banned_token_ids=banned,
            num_logprobs=nlp,
            all_greedy=all_greedy,
            any_top_k_top_p=bool((top_k > 0).any() or (ib.top_p[slots] < 1).any()),
            any_min_p=bool((ib.min_p[slots] > 0).any()),
        )
