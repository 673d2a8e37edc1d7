"""Turns a `SchedulerOutput` into device tensors, runs one forward over the flattened batch, samples.

It knows nothing of how steps are scheduled: any mix of prefill chunks and decodes, in any order.
Only the last position of each request that samples is projected through the LM head.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from core.args import EngineArgs
from core.models.layers import ForwardContext
from core.models.loader import ModelSource, load_model
from core.outputs import TokenLogprob
from core.sampler import SamplingBatch, sample
from core.scheduler import ModelOutput, ScheduledRequest, SchedulerOutput
from kv.attention import AttentionMetadata, allocate_kv_cache, get_attention_backend
from kv.attention.base import kv_bytes_per_block

logger = logging.getLogger("sluice")


class ModelRunner:
    def __init__(self, args: EngineArgs, source: ModelSource, max_model_len: int) -> None:
        self.args = args
        self.device = args.resolve_device()
        self.dtype = args.resolve_dtype(self.device)
        self.block_size = args.block_size
        self.max_model_len = max_model_len
        torch.manual_seed(args.seed)
        self.model = load_model(source, self.dtype, self.device, max_position=max_model_len, seed=args.seed)
        cfg = source.config
        backend = args.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        self.backend = get_attention_backend(backend)
        self.num_layers = cfg.num_hidden_layers
        self.spec = None  # speculative decoding: the draft head and its steps
        if args.speculative_model is not None:
            from core.spec_decode import SpecDecodeRunner

            self.spec = SpecDecodeRunner(self, source)
        self.num_kv_blocks = args.num_kv_blocks or self._blocks_from_memory()
        self.kv_caches = allocate_kv_cache(
            self.num_layers,
            self.num_kv_blocks,
            self.block_size,
            self.model.num_kv_heads,
            self.model.head_dim,
            self.dtype,
            self.device,
        )
        if self.spec is not None:
            self.spec.allocate_kv(self.num_kv_blocks)
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.generators: dict[str, torch.Generator] = {}
        logger.info(
            "KV pool: %d blocks x %d tokens = %d tokens (%s, %s)",
            self.num_kv_blocks,
            self.block_size,
            self.num_kv_blocks * self.block_size,
            self.device,
            self.dtype,
        )

    def _bytes_per_block(self) -> int:
        draft = self.spec.kv_bytes_per_block() if self.spec is not None else 0
        return draft + kv_bytes_per_block(
            self.num_layers, self.block_size, self.model.num_kv_heads, self.model.head_dim, self.dtype
        )

    def _blocks_from_memory(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * self.args.gpu_memory_utilization - (total - free) - 2 * 1024**3
        else:
            budget = self.args.cpu_kv_cache_gib * 1024**3
        return max(int(budget // self._bytes_per_block()), 16)

    # -- one step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelOutput:
        for rid in so.finished_request_ids:
            self.generators.pop(rid, None)
        if self.spec is not None:
            return self.spec.execute(so)
        if not so.requests:
            return ModelOutput(so.step_id, {})
        if so.block_copies:
            src = torch.tensor([s for s, _ in so.block_copies], device=self.device)
            dst = torch.tensor([d for _, d in so.block_copies], device=self.device)
            for kv in self.kv_caches:
                kv[:, dst] = kv[:, src]
        input_ids, positions, meta, logit_rows = self._prepare(so.requests)
        ctx = ForwardContext(meta, self.kv_caches, self.backend)
        hidden = self.model(input_ids, positions, ctx)
        sampling = [r for r in so.requests if r.sample]
        if not sampling:
            return ModelOutput(so.step_id, {})
        logits = self.model.compute_logits(hidden[logit_rows])
        if any(r.forks for r in sampling):
            # n > 1: each fork samples from its parent's last-prompt-token row (one prefill for all).
            logits = logits[[i for i, r in enumerate(sampling) for _ in range(1 + len(r.forks))]]
            sampling = [s for r in sampling for s in (r, *r.forks)]
        batch = self._sampling_batch(sampling)
        out = sample(logits, batch)
        tokens = out.token_ids.tolist()  # the step's one host sync
        sampled = {r.request_id: t for r, t in zip(sampling, tokens)}
        logprobs = None
        if out.logprobs is not None:
            logprobs = {}
            lp = out.logprobs.tolist()
            top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
            top_id = out.top_token_ids.tolist() if out.top_token_ids is not None else None
            for i, r in enumerate(sampling):
                n = r.sampling_params.logprobs
                if n is None:
                    continue
                top = list(zip(top_id[i][:n], top_lp[i][:n])) if top_id is not None and n > 0 else []
                logprobs[r.request_id] = TokenLogprob(tokens[i], lp[i], top)
        return ModelOutput(so.step_id, sampled, logprobs)

    def _prepare(self, reqs: list[ScheduledRequest]):
        bs = self.block_size
        lens = [len(r.token_ids) for r in reqs]
        starts = np.array([r.start_pos for r in reqs], dtype=np.int64)
        q_lens = np.array(lens, dtype=np.int64)
        qsl = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        seq_lens = starts + q_lens
        # positions: start_pos, start_pos + 1, ... for every request, flattened
        offsets = np.arange(qsl[-1]) - np.repeat(qsl[:-1], q_lens)
        positions = np.repeat(starts, q_lens) + offsets
        max_blocks = max(-(-int(s) // bs) for s in seq_lens)
        tables = np.zeros((len(reqs), max_blocks), dtype=np.int64)
        for i, r in enumerate(reqs):
            tables[i, : len(r.block_table)] = r.block_table[:max_blocks]
        req_idx = np.repeat(np.arange(len(reqs)), q_lens)
        slot_mapping = tables[req_idx, positions // bs] * bs + positions % bs
        input_ids = [t for r in reqs for t in r.token_ids]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev, non_blocking=True),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev, non_blocking=True),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(tables.astype(np.int32)).to(dev, non_blocking=True),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_host=qsl.tolist(),
            seq_lens_host=seq_lens.tolist(),
        )
        logit_rows = torch.tensor([qsl[i + 1] - 1 for i, r in enumerate(reqs) if r.sample], device=dev)
        return (
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.from_numpy(positions).to(dev, non_blocking=True),
            meta,
            logit_rows,
        )

    def _generator(self, r: ScheduledRequest) -> torch.Generator | None:
        seed = r.sampling_params.seed
        if seed is None or r.sampling_params.temperature == 0:
            return None
        g = self.generators.get(r.request_id)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(seed)
            self.generators[r.request_id] = g
        return g

    def _sampling_batch(self, reqs: list[ScheduledRequest]) -> SamplingBatch:
        dev = self.device
        sps = [r.sampling_params for r in reqs]
        f = lambda xs: torch.tensor(xs, dtype=torch.float32, device=dev)
        temperature = f([p.temperature for p in sps])
        any_pen = any(r.output_token_ids is not None for r in reqs)
        banned = [
            list(r.eos_token_ids) * (not p.ignore_eos) + list(p.stop_token_ids)
            if r.num_output_tokens < p.min_tokens
            else []
            for r, p in zip(reqs, sps)
        ]
        nlp = [p.logprobs for p in sps if p.logprobs is not None]
        return SamplingBatch(
            temperature=temperature,
            top_k=torch.tensor([p.top_k if p.top_k > 0 else 0 for p in sps], dtype=torch.long, device=dev),
            top_p=f([p.top_p for p in sps]),
            min_p=f([p.min_p for p in sps]),
            generators=[self._generator(r) for r in reqs],
            presence_penalty=f([p.presence_penalty for p in sps]) if any_pen else None,
            frequency_penalty=f([p.frequency_penalty for p in sps]) if any_pen else None,
            repetition_penalty=f([p.repetition_penalty for p in sps]) if any_pen else None,
            output_token_ids=[r.output_token_ids or [] for r in reqs] if any_pen else None,
            prompt_token_ids=[r.prompt_token_ids or [] for r in reqs] if any_pen else None,
            banned_token_ids=banned if any(banned) else None,
            num_logprobs=max(nlp) if nlp else -1,
            all_greedy=all(p.temperature == 0 for p in sps),
            any_top_k_top_p=any(p.top_k > 0 or p.top_p < 1 for p in sps),
            any_min_p=any(p.min_p > 0 for p in sps),
        )
