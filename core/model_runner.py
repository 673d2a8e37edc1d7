"""Turns a `SchedulerOutput` into device tensors, runs one forward over the flattened batch, samples.

It knows nothing of how steps are scheduled: any mix of prefill chunks and decodes, in any order.
Only the last position of each request that samples is projected through the LM head.

Hot path (per step, not per token): step inputs are written with numpy into preallocated (pinned, on
the GPU) buffers and copied to the device asynchronously (`core/cuda_graphs.py: StepBuffers`); pure
decode steps replay a captured CUDA graph; the one host sync is reading the sampled tokens back.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys

import numpy as np
import torch
from sluice.core.args import EngineArgs
from sluice.core.cuda_graphs import DecodeGraphs, StepBuffers, graph_batch_sizes
from sluice.core.models.layers import ForwardContext, enable_fused_kernels
from sluice.core.models.loader import ModelSource, load_model
from sluice.core.models.quant import weight_bytes
from sluice.core.sampler import SamplingBatch, min_tokens_bans, sample, token_logprobs
from sluice.core.step import ModelOutput, ScheduledRequest, SchedulerOutput
from sluice.kv.attention import AttentionMetadata, allocate_kv_cache, fp8, get_attention_backend
from sluice.kv.attention.base import kv_bytes_per_block
from sluice.kv.attention.fp8 import kv_cache_torch_dtype

logger = logging.getLogger("sluice")

GiB = 1024**3
# Room left beside the KV pool for the decode graphs' memory pool (activations of the largest captured
# batch and its logits), which is allocated after the pool is sized.
GRAPH_POOL_RESERVE = GiB // 2
# The executor's worker thread and the event loop share the GIL; under load the loop detokenizes for
# milliseconds at a time, and a thread waiting for the GIL gets it only after the switch interval
# (5 ms by default), leaving the GPU idle. A shorter interval bounds that wait. SLUICE_GPU_SWITCH_INTERVAL_S
# overrides it (for measuring the trade-off; the loop's own work gets switched away from more often).
GPU_SWITCH_INTERVAL_S = 0.0005


class ModelRunner:
    """With ``tp`` (tensor parallel, one runner per rank in its own process, `core/tp_worker.py`): this
    rank's shard of the model and its heads' KV pool; every rank runs each step, rank 0 samples."""

    def __init__(self, args: EngineArgs, source: ModelSource, max_model_len: int, tp=None) -> None:
        self.args = args
        self.tp = tp
        self.device = args.resolve_device()
        self.dtype = args.resolve_dtype(self.device)
        self.block_size = args.block_size
        self.max_model_len = max_model_len
        torch.manual_seed(args.seed)
        self.model = load_model(source, self.dtype, self.device, max_position=max_model_len, seed=args.seed, tp=tp)
        if args.quantization is not None:
            from sluice.core.models.quant import quantize_model  # imports the gguf reader

            counts = quantize_model(
                self.model,
                args.quantization,
                source.gguf_file if tp is None else None,  # a rank holds a shard: quantized from it
                include_lm_head=args.speculative_model is None,
            )
            logger.info("quantization %s: %s linear layers", args.quantization, counts)
        cfg = source.config
        backend = args.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        self.backend = get_attention_backend(backend)
        self.kv_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, self.dtype)
        if fp8.is_fp8(self.kv_dtype):
            from sluice.core.models.quant import calibrate_kv_scales

            scales = calibrate_kv_scales(
                self.model, self.backend, self.dtype, self.device, seq_len=min(256, max_model_len), seed=args.seed
            )
            logger.info("fp8 KV cache: per-head scales from calibration, %.3g..%.3g", scales.min(), scales.max())
        fused = args.fused_kernels
        if fused == "auto":
            fused = "on" if self.device.type == "cuda" else "off"
        self.fused_kernels = fused == "on"  # the draft head follows the target
        if fused == "on":
            logger.info(
                "fused kernels (RMSNorm+residual, SiLU-and-mul, RoPE): %d modules", enable_fused_kernels(self.model)
            )
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = cfg.vocab_size
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.max_num_seqs = args.max_num_seqs
        self.max_num_tokens = max(args.max_num_batched_tokens, args.max_num_seqs)
        self.buffers = StepBuffers(self.max_num_tokens, self.max_num_seqs, self.max_blocks_per_seq, self.device)
        self.generators: dict[str, torch.Generator] = {}
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda":
            interval = float(os.environ.get("SLUICE_GPU_SWITCH_INTERVAL_S", GPU_SWITCH_INTERVAL_S))
            sys.setswitchinterval(min(sys.getswitchinterval(), interval))
        self.spec = None  # speculative decoding: the draft head and its steps
        if args.speculative_model is not None:
            from sluice.core.spec_decode import SpecDecodeRunner

            self.spec = SpecDecodeRunner(self, source)
        self.num_kv_blocks = args.num_kv_blocks or self._blocks_from_memory()
        if tp is not None:  # one block table serves every rank: the smallest pool bounds them all
            self.num_kv_blocks = tp.min_int(self.num_kv_blocks)
        self.kv_caches = allocate_kv_cache(
            self.num_layers,
            self.num_kv_blocks,
            self.block_size,
            self.model.num_kv_heads,
            self.model.head_dim,
            self.kv_dtype,
            self.device,
        )
        if self.spec is not None:
            self.spec.allocate_kv(self.num_kv_blocks)
        logger.info(
            "weights: %.3f GiB (%s, %s); KV pool: %d blocks x %d tokens = %d tokens, %.3f GiB (%s)",
            weight_bytes(self.model) / GiB,
            self.dtype,
            args.quantization or "unquantized",
            self.num_kv_blocks,
            self.block_size,
            self.num_kv_blocks * self.block_size,
            self.num_kv_blocks * self._bytes_per_block() / GiB,
            self.kv_dtype,
        )
        if self.device.type == "cuda" and not args.enforce_eager and tp is None:
            if getattr(self.backend, "graph_safe", False):
                graphs = DecodeGraphs(
                    self._decode_forward, self.buffers, graph_batch_sizes(self.max_num_seqs), max_model_len
                )
                try:
                    with torch.inference_mode():
                        graphs.capture()
                    self.graphs = graphs
                    if self.spec is not None:
                        self.spec.capture_graphs()
                except Exception:  # slower, still correct: serve every step eagerly
                    logger.exception("CUDA graph capture failed; decode steps run eagerly")
                    self.graphs = None
                    if self.spec is not None:
                        self.spec.graphs = None
                    del graphs
                    torch.cuda.synchronize(self.device)
                    torch.cuda.empty_cache()
            else:
                logger.info("CUDA graphs off: the %s attention backend is not graph-safe", self.backend.name)

    # -- memory --------------------------------------------------------------------------------------
    def _bytes_per_block(self) -> int:
        draft = self.spec.kv_bytes_per_block() if self.spec is not None else 0
        return draft + kv_bytes_per_block(
            self.num_layers, self.block_size, self.model.num_kv_heads, self.model.head_dim, self.kv_dtype
        )

    def _blocks_from_memory(self) -> int:
        if self.device.type != "cuda":
            return max(int(self.args.cpu_kv_cache_gib * GiB // self._bytes_per_block()), 16)
        return self._profile_kv_blocks()

    @torch.inference_mode()
    def _profile_kv_blocks(self) -> int:
        """Size the KV pool from a profiling run: the largest step the scheduler can send (all of
        ``max_num_batched_tokens`` as prefill) and sampling at ``max_num_seqs`` rows with top-p, measured
        as peak allocated memory; then ``gpu_memory_utilization`` of the card minus weights, that peak,
        memory outside torch, and a reserve for the graphs; the rest is cut into blocks."""
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        weights = torch.cuda.memory_allocated(dev)
        # no step holds more than max_num_seqs sequences of max_model_len tokens (with one sequence and a
        # token budget above max_model_len, the profile's own batch must not exceed the step buffers either)
        n_tok = min(self.max_num_tokens, self.max_num_seqs * self.max_model_len)
        n_seq = max(1, -(-n_tok // self.max_model_len))
        lens = [n_tok // n_seq + (1 if i < n_tok % n_seq else 0) for i in range(n_seq)]
        n_blocks = sum(-(-n // self.block_size) for n in lens)
        tmp_cache = allocate_kv_cache(
            self.num_layers, n_blocks, self.block_size, self.model.num_kv_heads, self.model.head_dim, self.kv_dtype, dev
        )
        tmp_bytes = sum(t.numel() * t.element_size() for t in tmp_cache)
        g = torch.Generator(device="cpu").manual_seed(0)
        reqs, next_block = [], 0
        for i, n in enumerate(lens):
            nb = -(-n // self.block_size)
            ids = torch.randint(0, self.vocab_size, (n,), generator=g).tolist()
            reqs.append(ScheduledRequest(f"profile-{i}", ids, 0, list(range(next_block, next_block + nb)), True))
            next_block += nb
        n_rows = self._prepare(reqs, self.buffers, graph_bs=None)
        b = self.buffers
        meta = self._metadata(reqs, b, len(reqs))
        hidden = self.model(b.input_ids[:n_tok], b.positions[:n_tok], ForwardContext(meta, tmp_cache, self.backend))
        del hidden
        rows = min(self.max_num_seqs, n_tok)
        logits = self.model.compute_logits(
            torch.randn(rows, self.model.config.hidden_size, device=dev, dtype=self.dtype)
        )
        batch = SamplingBatch(
            temperature=torch.ones(rows, device=dev),
            top_k=torch.full((rows,), 50, dtype=torch.long, device=dev),
            top_p=torch.full((rows,), 0.9, device=dev),
            min_p=torch.full((rows,), 0.05, device=dev),
            generators=[None] * rows,
        )
        sample(logits, batch).token_ids.tolist()
        del logits, n_rows
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        del tmp_cache
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved(dev))
        activations = max(0, peak - weights - tmp_bytes)
        reserve = 0 if self.args.enforce_eager else GRAPH_POOL_RESERVE
        budget = total * self.args.gpu_memory_utilization - weights - activations - non_torch - reserve
        blocks = int(budget // self._bytes_per_block())
        logger.info(
            "memory profile: card %.1f GiB x %.2f; weights %.2f GiB, peak activations %.2f GiB (step of %d tokens, "
            "sampling %d rows), outside torch %.2f GiB, graph reserve %.2f GiB -> KV budget %.2f GiB",
            total / GiB,
            self.args.gpu_memory_utilization,
            weights / GiB,
            activations / GiB,
            n_tok,
            rows,
            non_torch / GiB,
            reserve / GiB,
            budget / GiB,
        )
        if blocks < 1:
            raise MemoryError(
                f"no room for the KV cache: budget {budget / GiB:.2f} GiB at gpu_memory_utilization="
                f"{self.args.gpu_memory_utilization} (weights {weights / GiB:.2f} GiB, activations "
                f"{activations / GiB:.2f} GiB)"
            )
        return blocks

    # -- one step ----------------------------------------------------------------------------------
    def copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        """Carry out copy-on-write orders in every layer, the draft head's KV included, before the step's
        attention."""
        if not block_copies:
            return
        src = torch.tensor([s for s, _ in block_copies], device=self.device)
        dst = torch.tensor([d for _, d in block_copies], device=self.device)
        for kv in self.kv_caches:
            if fp8.is_fp8(kv):
                kv = kv.view(torch.uint8)  # index_put has no fp8 kernel on every device
            kv[:, dst] = kv[:, src]
        if self.spec is not None:
            self.spec.proposer.copy_blocks(src, dst)

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelOutput:
        for rid in so.finished_request_ids:
            self.generators.pop(rid, None)
        if self.spec is not None:
            self.spec.forget(so.finished_request_ids)
            # A step without drafts to verify or draft work (speculation off above
            # speculative_disable_batch_size) is a plain step: CUDA graphs, no speculative overhead.
            if any(r.spec or r.num_draft_tokens for r in so.requests):
                return self.spec.execute(so)
        reqs = so.requests
        if not reqs:
            return ModelOutput(so.step_id, {})
        self.copy_blocks(so.block_copies)
        n = len(reqs)
        sampling_idx = [i for i, r in enumerate(reqs) if r.sample]
        graph_bs = None
        if self.graphs is not None and all(len(r.token_ids) == 1 for r in reqs):
            graph_bs = self.graphs.padded_size(n)
        b = self.buffers
        num_tokens = sum(len(r.token_ids) for r in reqs)
        if num_tokens > b.max_tokens or n > b.max_seqs:
            # larger than the scheduler's limits promise (never in normal use): a one-off eager buffer
            b = StepBuffers(num_tokens, n, self.max_blocks_per_seq, self.device)
            graph_bs = None
        self._prepare(reqs, b, graph_bs, sampling_idx)
        if graph_bs is not None:
            logits = self.graphs.replay(graph_bs)
            logits = logits[:n] if len(sampling_idx) == n else logits[b.logit_rows[: len(sampling_idx)]]
        else:
            meta = self._metadata(reqs, b, n)
            ctx = ForwardContext(meta, self.kv_caches, self.backend)
            hidden = self.model(b.input_ids[:num_tokens], b.positions[:num_tokens], ctx)
            if not sampling_idx:
                return ModelOutput(so.step_id, {})
            logits = self.model.compute_logits(hidden[b.logit_rows[: len(sampling_idx)]])
        if not sampling_idx or (self.tp is not None and self.tp.rank != 0):
            return ModelOutput(so.step_id, {})
        sampling = [reqs[i] for i in sampling_idx]
        if any(r.forks for r in sampling):
            # n > 1: each fork samples from its parent's last-prompt-token row (one prefill for all).
            logits = logits[[i for i, r in enumerate(sampling) for _ in range(1 + len(r.forks))]]
            sampling = [s for r in sampling for s in (r, *r.forks)]
        batch = self._sampling_batch(sampling, b)
        if batch is None:  # every row greedy, no penalties, bans or logprobs
            tokens = logits.argmax(-1).tolist()  # the step's one host sync
            return ModelOutput(so.step_id, {r.request_id: t for r, t in zip(sampling, tokens)})
        out = sample(logits, batch)
        tokens = out.token_ids.tolist()  # the step's one host sync
        sampled = {r.request_id: t for r, t in zip(sampling, tokens)}
        logprobs = token_logprobs(sampling, tokens, out)
        return ModelOutput(so.step_id, sampled, logprobs)

    def _decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """The captured part of a decode step: embedding to logits of every row."""
        hidden = self.model(input_ids, positions, ForwardContext(meta, self.kv_caches, self.backend))
        return self.model.compute_logits(hidden)

    def _prepare(
        self,
        reqs: list[ScheduledRequest],
        b: StepBuffers,
        graph_bs: int | None,
        sampling_idx: list[int] | None = None,
    ) -> int:
        """Write the step's inputs into ``b`` (host side, vectorized) and start their copies to the device.
        With ``graph_bs`` (a graph's batch size; every request then computes the same number of tokens q),
        sequences ``len(reqs)..graph_bs`` are padding of q tokens each that write and read no KV. Returns
        the number of logit rows."""
        bs = self.block_size
        n = len(reqs)
        q_lens = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int64, count=n)
        starts = np.fromiter((r.start_pos for r in reqs), dtype=np.int64, count=n)
        qsl = b.query_start_loc_np[: n + 1]
        qsl[0] = 0
        np.cumsum(q_lens, out=qsl[1:])
        t = int(qsl[n])
        seq_lens = starts + q_lens
        b.seq_lens_np[:n] = seq_lens
        b.input_ids_np[:t] = np.fromiter(itertools.chain.from_iterable(r.token_ids for r in reqs), np.int64, t)
        positions = b.positions_np[:t]
        if t == n:
            positions[:] = starts
            req_idx = np.arange(n)
        else:
            req_idx = np.repeat(np.arange(n), q_lens)
            positions[:] = np.arange(t) - np.repeat(qsl[:n].astype(np.int64) - starts, q_lens)
        # block tables: whole rows, only the prefix each request owns is written (the rest is never read)
        bt_lens = np.fromiter((len(r.block_table) for r in reqs), dtype=np.int64, count=n)
        np.minimum(bt_lens, b.max_blocks, out=bt_lens)
        total = int(bt_lens.sum())
        flat = np.fromiter(
            itertools.chain.from_iterable(r.block_table[: b.max_blocks] for r in reqs), dtype=np.int32, count=total
        )
        rows = np.repeat(np.arange(n), bt_lens)
        cols = np.arange(total) - np.repeat(np.cumsum(bt_lens) - bt_lens, bt_lens)
        tables = b.block_tables_np
        tables[rows, cols] = flat
        b.slot_mapping_np[:t] = tables[req_idx, positions // bs].astype(np.int64) * bs + positions % bs
        num_rows = 0
        if sampling_idx is None:
            sampling_idx = [i for i, r in enumerate(reqs) if r.sample]
        if graph_bs is not None:
            q = t // n
            pad = slice(t, graph_bs * q)
            b.input_ids_np[pad] = 0
            b.positions_np[pad] = 0
            b.slot_mapping_np[pad] = -1
            b.seq_lens_np[n:graph_bs] = 0
            b.query_start_loc_np[n + 1 : graph_bs + 1] = np.arange(n + 1, graph_bs + 1) * q
            if len(sampling_idx) != n:
                num_rows = len(sampling_idx)
                b.logit_rows_np[:num_rows] = sampling_idx
            t, n = graph_bs * q, graph_bs
        else:
            num_rows = len(sampling_idx)
            b.logit_rows_np[:num_rows] = qsl[1:][sampling_idx] - 1
        b.upload(t, n, b.max_blocks, num_rows)
        return num_rows

    def _metadata(self, reqs: list[ScheduledRequest], b: StepBuffers, n: int) -> AttentionMetadata:
        qsl = b.query_start_loc_np[: n + 1]
        seq_lens = b.seq_lens_np[:n]
        return AttentionMetadata(
            slot_mapping=b.slot_mapping[: int(qsl[n])],
            query_start_loc=b.query_start_loc[: n + 1],
            seq_lens=b.seq_lens[:n],
            block_tables=b.block_tables[:n],
            max_query_len=int((qsl[1:] - qsl[:-1]).max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_host=qsl.tolist(),
            seq_lens_host=seq_lens.tolist(),
        )

    # -- sampling ----------------------------------------------------------------------------------
    def _generator(self, r: ScheduledRequest) -> torch.Generator | None:
        seed = r.sampling_params.seed
        if seed is None or r.sampling_params.temperature == 0:
            return None
        g = self.generators.get(r.request_id)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(seed)
            self.generators[r.request_id] = g
        return g

    def _sampling_batch(self, reqs: list[ScheduledRequest], b: StepBuffers) -> SamplingBatch | None:
        """The sampler's per-row parameters, or None when plain argmax serves every row."""
        sps = [r.sampling_params for r in reqs]
        any_pen = any(r.output_token_ids is not None for r in reqs)
        banned = min_tokens_bans(reqs)
        any_banned = any(banned)
        nlp = [p.logprobs for p in sps if p.logprobs is not None]
        all_greedy = all(p.temperature == 0 for p in sps)
        if all_greedy and not any_pen and not any_banned and not nlp:
            return None
        k = len(reqs)
        if k > b.max_seqs:
            b = StepBuffers(1, k, 1, self.device)
        f = b.sampling_f_np
        f[0, :k] = [p.temperature for p in sps]
        f[1, :k] = [p.top_p for p in sps]
        f[2, :k] = [p.min_p for p in sps]
        if any_pen:
            f[3, :k] = [p.presence_penalty for p in sps]
            f[4, :k] = [p.frequency_penalty for p in sps]
            f[5, :k] = [p.repetition_penalty for p in sps]
        b.top_k_np[:k] = [max(p.top_k, 0) for p in sps]
        b.upload_sampling(k, any_pen)
        dev = b.sampling_f
        return SamplingBatch(
            temperature=dev[0, :k],
            top_k=b.top_k[:k],
            top_p=dev[1, :k],
            min_p=dev[2, :k],
            generators=[self._generator(r) for r in reqs],
            presence_penalty=dev[3, :k] if any_pen else None,
            frequency_penalty=dev[4, :k] if any_pen else None,
            repetition_penalty=dev[5, :k] if any_pen else None,
            output_token_ids=[r.output_token_ids or [] for r in reqs] if any_pen else None,
            prompt_token_ids=[r.prompt_token_ids or [] for r in reqs] if any_pen else None,
            banned_token_ids=banned if any_banned else None,
            num_logprobs=max(nlp) if nlp else -1,
            all_greedy=all_greedy,
            any_top_k_top_p=any(p.top_k > 0 or p.top_p < 1 for p in sps),
            any_min_p=any(p.min_p > 0 for p in sps),
        )
