"""The one model runner: applies a step's changes to the persistent batch, builds the step's inputs, runs
one forward over the flattened batch, samples, and (with a draft head) verifies and drafts.

It knows nothing of how steps are scheduled: any mix of prefill chunks, decodes and verifications, in
any order. Only the positions that sample are projected through the LM head.

A step is launched, then collected. `launch` enqueues the device work (inputs copied from pinned buffers,
a CUDA graph replayed for uniform decode steps, sampling) and starts copying the sampled tokens back;
`collect` waits for them. Between the two the host is free: the executor launches the next step first
(asynchronous scheduling), whose decodes take their input token from this step's samples on the device.
Steps that speculate are the same launch with the drafter's tail (`core/worker/drafter.py`, a collaborator
handed its inputs), computed whole in `launch` (their drafts decide the next step).

One step-input builder (`InputBatch.build`) and one sampling-batch builder (`SamplingBatchBuilder`) serve every
step, the speculative ones and the memory profile included.
"""

from __future__ import annotations

import functools
import logging
import time

import numpy as np
import torch
from sluice.core import envs
from sluice.core.args import EngineArgs
from sluice.core.models.layers import ForwardContext, argmax_rows, enable_cpu_kernels, enable_fused_kernels
from sluice.core.models.loader import ModelSource, load_model
from sluice.core.models.quant import weight_bytes
from sluice.core.sampling_params import SamplingParams
from sluice.core.step import ModelOutput, NewRequest, SchedulerOutput
from sluice.core.structured.matchers import GrammarRows
from sluice.core.structured.registry import DEFAULT_BACKEND, load_backend
from sluice.core.worker.cpu_compiled import CompiledDecode
from sluice.core.worker.cuda_graphs import DecodeGraphs, MixedGraphs, graph_batch_sizes, mixed_graph_sizes
from sluice.core.worker.culprit import is_fatal, isolate_culprits
from sluice.core.worker.drafter import Drafter, SpecRows
from sluice.core.worker.input_batch import InputBatch, StepRows, attention_metadata, sampling_rows
from sluice.core.worker.memory_profile import GiB, largest_step_lens, profile_kv_blocks
from sluice.core.worker.read_back import ReadBackRings
from sluice.core.worker.runner import LaunchedStep
from sluice.core.worker.sampler import SamplerOutput, SamplingBatch, sample, token_logprobs
from sluice.core.worker.sampling_batch import SamplingBatchBuilder, SeededGenerators
from sluice.core.worker.step_buffers import StepBuffers, StepLimits
from sluice.core.worker.target import TargetForward
from sluice.kv.attention import AttentionMetadata, allocate_kv_cache, fp8, get_attention_backend
from sluice.kv.attention.base import kv_bytes_per_block
from sluice.kv.attention.fp8 import kv_cache_torch_dtype

logger = logging.getLogger("sluice")


class ModelRunner:
    """The `Runner` in this process. With ``tp`` (tensor parallel, one runner per rank in its own process,
    `core/worker/tp/worker.py`): this rank's shard of the model and its heads' KV pool; every rank runs each
    step, rank 0 samples and broadcasts the tokens, so every rank's persistent batch knows them."""

    overlaps_steps = True  # a decode takes its input token from the step in flight's samples, on the device
    out_of_process = False
    failure: Exception | None = None  # a failed step fails its own requests only

    def __init__(self, args: EngineArgs, source: ModelSource, max_model_len: int, tp=None) -> None:
        envs.configure_kernels()  # the kernels' process-wide switches, before anything launches one
        self.args = args
        self.tp = tp
        self.samples = tp is None or tp.rank == 0  # the rank that samples (and keeps the grammars)
        self.device = args.resolve_device()
        gguf = source.gguf_file if tp is None else None  # a rank holds a shard: quantized from it, not the file
        self.dtype = args.resolve_dtype(self.device, gguf)
        self.quantization = args.resolve_quantization(self.device, gguf)
        self.block_size = args.block_size
        self.max_model_len = max_model_len
        torch.manual_seed(args.seed)
        self.model = self._load_model(source)
        backend = args.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        self.backend = get_attention_backend(backend, **envs.attention_backend_options())
        self.kv_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, self.dtype)
        if fp8.is_fp8(self.kv_dtype):
            self._calibrate_kv_scales()
        self.fused_kernels = self._fuse_kernels()  # the draft head follows the target
        self.num_layers = source.config.num_hidden_layers
        self.vocab_size = source.config.vocab_size
        self.source = source
        self.max_num_seqs = args.max_num_seqs
        self.max_num_tokens = max(args.max_num_batched_tokens, args.max_num_seqs)
        self.drafter = None  # speculative decoding: the draft head, verification and drafting
        if args.speculative_model is not None:
            self.drafter = Drafter(
                args, source, max_model_len, self.device, self.dtype, self.fused_kernels, self.quantization
            )
        self.graphs: DecodeGraphs | CompiledDecode | None = None  # CUDA graphs, or the CPU's compiled step
        self.mixed_graphs: MixedGraphs | None = None
        self._init_step_state()
        self._init_kv_pool()
        if self.device.type == "cuda" and not args.enforce_eager and tp is None:
            if self.backend.graph_safe:
                self._capture_graphs()
            else:
                logger.info("CUDA graphs off: the %s attention backend is not graph-safe", self.backend.name)
        elif self.device.type == "cpu" and args.cpu_compile:
            self._compile_cpu_decode()
        self.warm_up_eager()
        if self.device.type == "cuda" and envs.SLUICE_SYNC_DEBUG:
            # a warning (with where) at each call that makes the host wait for the device: none belongs in a step
            torch.cuda.set_sync_debug_mode("warn")

    # -- start-up, in order --------------------------------------------------------------------------
    def _load_model(self, source: ModelSource):
        args, tp = self.args, self.tp
        model = load_model(source, self.dtype, self.device, max_position=self.max_model_len, seed=args.seed, tp=tp)
        if self.quantization is not None:
            from sluice.core.models.quant import quantize_model  # imports the gguf reader

            counts = quantize_model(
                model,
                self.quantization,
                source.gguf_file if tp is None else None,  # a rank holds a shard: quantized from it
                include_lm_head=args.speculative_model is None,
                requantize=args.quantization != "auto",  # auto: the file's own Q4_1 blocks only
            )
            logger.info("quantization %s: %s linear layers", self.quantization, counts)
            if self.device.type == "cpu":
                from sluice.core.models.cpu_linear import pack_for_cpu

                pack_for_cpu(model, self.dtype)  # a draft head reads the tied head's embedding table, not the copy
        return model

    def _calibrate_kv_scales(self) -> None:
        from sluice.core.models.quant import calibrate_kv_scales  # imports the gguf reader

        scales = calibrate_kv_scales(
            self.model, self.backend, self.dtype, self.device, seq_len=min(256, self.max_model_len), seed=self.args.seed
        )
        logger.info("fp8 KV cache: per-head scales from calibration, %.3g..%.3g", scales.min(), scales.max())

    def _fuse_kernels(self) -> bool:
        """The Triton kernels (on a GPU, or ``on``); with ``auto`` on the CPU, a 16-bit model's CPU kernels (fp32
        on the CPU is the reference configuration and keeps the reference modules); returns whether Triton's."""
        fused = self.args.fused_kernels
        if fused == "auto" and self.device.type == "cpu" and self.dtype != torch.float32:
            n = enable_cpu_kernels(self.model)
            logger.info("CPU kernels (RMSNorm+residual, SiLU-and-mul, RoPE): %d modules", n)
        if fused == "auto":
            fused = "on" if self.device.type == "cuda" else "off"
        if fused == "on":
            logger.info(
                "fused kernels (RMSNorm+residual, SiLU-and-mul, RoPE): %d modules",
                enable_fused_kernels(self.model, **envs.fused_kernel_options()),
            )
        return fused == "on"

    def _init_step_state(self) -> None:
        """The persistent batch, the step buffers and what a launched step is read back through."""
        k = self.num_speculative_tokens
        # draft lookahead slots may reach past max_model_len
        self.max_blocks_per_seq = -(-(self.max_model_len + 2 * k + 1) // self.block_size)
        self.buffers = StepBuffers(self.max_num_tokens, self.max_num_seqs, self.max_blocks_per_seq, self.device)
        # a dropped request's slot is reused a step later: room for a whole batch dropped and replaced
        self.batch = InputBatch(2 * self.max_num_seqs + 2, self.max_blocks_per_seq, self.block_size, k)
        # prefill/decode disaggregation (core/disagg/engine.py): a decode engine skips the prefill engine's draw
        self.generators = SeededGenerators(self.batch, self.device, self.vocab_size, self.args.kv_role == "decode")
        self.sampling = SamplingBatchBuilder(self.batch, self.generators, self.device)
        # structured outputs: the constrained requests' matchers and their rows' bitmask (core/structured/). The
        # backend's factory holds values, not the runner: a closure over self would put the runner in a reference
        # cycle, and a closed engine's model and KV pool would then wait for a full collection to be freed.
        src = self.source
        self.grammar = GrammarRows(
            functools.partial(
                load_backend, DEFAULT_BACKEND, src.tokenizer_dir, self.vocab_size, list(src.eos_token_ids)
            ),
            self.vocab_size,
            self.max_num_seqs * (k + 1),
            self.device,
        )
        self._inflight: LaunchedStep | None = None  # the last launched step, until it is read back
        self._last_sampled: torch.Tensor | None = None  # its sampled tokens, on the device
        self.rings = ReadBackRings(self.device, self.max_num_tokens)
        self._pad_head_rows = envs.SLUICE_PAD_HEAD_ROWS  # `_head_rows`

    def _init_kv_pool(self) -> None:
        """Size the KV pool (from the engine args, or from a memory profile), allocate it, and the draft head's."""
        self.num_kv_blocks = self.args.num_kv_blocks or self._blocks_from_memory()
        if self.tp is not None:  # one block table serves every rank: the smallest pool bounds them all
            self.num_kv_blocks = self.tp.min_int(self.num_kv_blocks)
        self.kv_caches = allocate_kv_cache(
            self.num_layers,
            self.num_kv_blocks,
            self.block_size,
            self.model.num_kv_heads,
            self.model.head_dim,
            self.kv_dtype,
            self.device,
        )
        self.target = TargetForward(
            self.model, self.kv_caches, self.backend, self.drafter.feature_layers if self.drafter is not None else ()
        )
        if self.drafter is not None:
            limits = StepLimits(self.max_num_tokens, self.max_num_seqs, self.max_blocks_per_seq, self.batch.max_slots)
            uniform_steps = self.tp is None and self.backend.graph_safe
            self.drafter.allocate_kv(self.num_kv_blocks, self.target, limits, uniform_steps)
        logger.info(
            "weights: %.3f GiB (%s, %s); KV pool: %d blocks x %d tokens = %d tokens, %.3f GiB (%s)",
            weight_bytes(self.model) / GiB,
            self.dtype,
            self.quantization or "unquantized",
            self.num_kv_blocks,
            self.block_size,
            self.num_kv_blocks * self.block_size,
            self.num_kv_blocks * self.kv_bytes_per_block() / GiB,
            self.kv_dtype,
        )

    def _capture_graphs(self) -> None:
        """CUDA graphs of decode steps, of mixed steps and of the drafter's uniform steps, in one memory pool.
        A failed capture leaves every step eager: slower, still correct."""
        graphs = DecodeGraphs(
            self._decode_forward, self.buffers, graph_batch_sizes(self.max_num_seqs), self.max_model_len
        )
        max_mixed = min(self.args.max_graph_tokens, self.max_num_tokens)
        mixed = None
        if max_mixed > 1:
            mixed = MixedGraphs(self.mixed_forward, self.buffers, mixed_graph_sizes(max_mixed), self.max_model_len)
        try:
            with torch.inference_mode():
                pool = graphs.capture()
                if mixed is not None:
                    mixed.capture(pool)
            self.graphs, self.mixed_graphs = graphs, mixed
            if envs.SLUICE_GRAPH_ROUTES:  # 0: each step in its smallest graph
                self._route_graphs()
            if self.drafter is not None:
                self.drafter.capture_graphs()
        except Exception:
            logger.exception("CUDA graph capture failed; every step runs eagerly")
            self.graphs = self.mixed_graphs = mixed = None
            if self.drafter is not None:
                self.drafter.graphs = None
            del graphs
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _compile_cpu_decode(self) -> None:
        """The CPU's compiled decode step (`core/worker/cpu_compiled.py`), in the place of the decode graphs, where
        it serves: one process, no draft head, a 16- or 32-bit KV cache. A failed compile leaves every step eager."""
        if self.tp is not None or self.drafter is not None or fp8.is_fp8(self.kv_dtype):
            logger.info("CPU decode compile off: it serves one process without a draft head or an fp8 KV cache")
            return
        max_batch = min(self.max_num_seqs, CompiledDecode.MAX_BATCH)
        compiled = CompiledDecode(self.model, self.kv_caches, self.buffers, self.block_size, max_batch)
        try:
            compiled.capture()
        except Exception:
            logger.exception("compiling the CPU decode step failed; every step runs eagerly")
            return
        self.graphs = compiled

    @property
    def num_speculative_tokens(self) -> int:
        return self.drafter.k if self.drafter is not None else 0

    @property
    def max_uniform_batch(self) -> int:
        return self.drafter.max_uniform_batch if self.drafter is not None else 0

    def close(self) -> None:
        """Nothing outside this process to release."""

    def _route_graphs(self) -> None:
        """Each graph size to the fastest graph at least as large (`DecodeGraphs.route_to_fastest`). Only a
        speed-up: if timing fails, every step keeps its smallest graph."""
        try:
            with torch.inference_mode():
                for g in (self.graphs, self.mixed_graphs):
                    if g is not None:
                        g.route_to_fastest()
        except Exception:
            logger.exception("timing the CUDA graphs failed; each step replays its smallest graph")
            for g in (self.graphs, self.mixed_graphs):
                if g is not None:
                    g.routes = {}

    # -- memory --------------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block takes in every layer, the draft head's included."""
        draft = self.drafter.kv_bytes_per_block() if self.drafter is not None else 0
        return draft + kv_bytes_per_block(
            self.num_layers, self.block_size, self.model.num_kv_heads, self.model.head_dim, self.kv_dtype
        )

    def _blocks_from_memory(self) -> int:
        if self.device.type != "cuda":
            return max(int(self.args.cpu_kv_cache_gib * GiB // self.kv_bytes_per_block()), 16)
        return self._profile_kv_blocks()

    def _profile_kv_blocks(self) -> int:
        def run_on_temporary_pool() -> tuple[int, int, int]:
            tmp_cache = allocate_kv_cache(
                self.num_layers, self._largest_step_blocks(), self.block_size, self.model.num_kv_heads,
                self.model.head_dim, self.kv_dtype, self.device,
            )  # fmt: skip
            n_tok, n_rows = self._run_largest_step(tmp_cache)
            return n_tok, n_rows, sum(t.numel() * t.element_size() for t in tmp_cache)

        return profile_kv_blocks(self.device, self.args, self.kv_bytes_per_block(), run_on_temporary_pool)

    def _largest_step_blocks(self) -> int:
        lens = largest_step_lens(self.max_num_tokens, self.max_num_seqs, self.max_model_len)
        return sum(-(-n // self.block_size) for n in lens)

    @torch.inference_mode()
    def _run_largest_step(self, kv_caches: list[torch.Tensor]) -> tuple[int, int]:
        """One eager forward of the largest step (`largest_step_lens`, random tokens, its KV written to the first
        blocks of ``kv_caches``), then sampling at ``max_num_seqs`` rows with top-k, top-p and min-p: the most
        memory a step takes outside the graphs. Its own persistent batch; returns ``(tokens, sampled rows)``."""
        dev = self.device
        lens = largest_step_lens(self.max_num_tokens, self.max_num_seqs, self.max_model_len)
        g = torch.Generator(device="cpu").manual_seed(0)
        so, next_block = SchedulerOutput(0), 0
        for i, n in enumerate(lens):
            nb = -(-n // self.block_size)
            ids = torch.randint(0, self.vocab_size, (n,), generator=g).tolist()
            rid = f"profile-{i}"
            so.new_requests.append(NewRequest(rid, ids, n, list(range(next_block, next_block + nb)), _PROFILE_PARAMS))
            so.req_ids.append(rid)
            so.num_scheduled_tokens.append(n)
            so.num_computed_tokens.append(0)
            so.samples.append(True)
            next_block += nb
        n_tok, n_seq = sum(lens), len(lens)
        batch = InputBatch(n_seq, self.max_blocks_per_seq, self.block_size)  # the one builder, on its own slots
        batch.apply(so)
        b = self.buffers
        b.wait_uploaded()
        rows = batch.build(so, b)
        b.upload(rows.num_tokens, n_seq, b.max_blocks, 0)
        meta = attention_metadata(rows, b)
        hidden = self.model(b.input_ids[:n_tok], b.positions[:n_tok], ForwardContext(meta, kv_caches, self.backend))
        del hidden
        n_rows = min(self.max_num_seqs, n_tok)
        logits = self.model.compute_logits(
            torch.randn(n_rows, self.model.config.hidden_size, device=dev, dtype=self.dtype)
        )
        sampling = SamplingBatch(
            temperature=torch.ones(n_rows, device=dev),
            top_k=torch.full((n_rows,), 50, dtype=torch.long, device=dev),
            top_p=torch.full((n_rows,), 0.9, device=dev),
            min_p=torch.full((n_rows,), 0.05, device=dev),
            generators=[None] * n_rows,
        )
        self.grammar.warm_up(logits)  # the bitmask kernel, for the first constrained step
        sample(logits, sampling).token_ids.tolist()
        logits.argmax(-1).tolist()  # what an all-greedy step does instead
        return n_tok, n_rows

    def warm_up_eager(self) -> None:
        """Run the largest eager step once after start-up (CUDA), as vLLM's warm-up does: Triton compiles the
        eager path's kernel variants, and the caching allocator takes from the driver the memory such a step
        needs and keeps it. Otherwise the first burst of prompts pays for both inside its first steps, while the
        device waits (allocating device memory may wait for the device, too). Its KV goes to the first blocks of
        the pool, free at start-up. ``SLUICE_EAGER_WARMUP=0`` skips it; ``=1`` runs it on the CPU too (tests)."""
        flag = envs.SLUICE_EAGER_WARMUP
        if flag is False or (flag is None and self.device.type != "cuda"):
            return
        if self._largest_step_blocks() > self.num_kv_blocks:  # a pool smaller than one largest step: nothing to warm
            return
        self._run_largest_step(self.kv_caches)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

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
        if self.drafter is not None:
            self.drafter.proposer.copy_blocks(src, dst)

    def execute(self, so: SchedulerOutput) -> ModelOutput:
        """Launch and collect one step (callers that do not overlap steps)."""
        return self.collect(self.launch(so))

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> LaunchedStep:
        for rid in self.batch.apply(so):
            self.generators.drop(rid)
            self.grammar.drop(rid)
        if self.samples:
            for nr in so.new_requests:
                spec = nr.sampling_params.structured_outputs
                if spec is not None:  # resumed or handed over: caught up with the outputs it arrived with
                    self.grammar.add(nr.request_id, spec, nr.token_ids[nr.num_prompt_tokens :])
        if self.drafter is not None:
            self.drafter.forget(so.finished_request_ids, so.preempted_request_ids)
        if not so.req_ids:
            return LaunchedStep(so, ModelOutput(so.step_id))
        self.copy_blocks(so.block_copies)
        try:
            return self._launch_rows(so)
        except Exception as e:
            if is_fatal(e) or self.tp is not None or (so.num_reqs == 1 and not so.forks) or so.uniform:
                # nobody else to spare (tensor-parallel ranks would each bisect on their own); a uniform step's
                # rows may take their inputs from the device, which a re-run from host tokens cannot
                raise
            logger.warning("step %d failed (%s); re-running its rows to find the culprits", so.step_id, e)
            return LaunchedStep(so, self._isolate(so, e))

    def _isolate(self, so: SchedulerOutput, error: Exception) -> ModelOutput:
        """Re-run the rows of a failed step in groups until the failure is pinned on its culprits
        (`core/worker/culprit.py`); synchronous, from host tokens."""
        self._read_back(self._inflight)
        ib = self.batch

        def run(sub: SchedulerOutput) -> ModelOutput:
            # the failed attempt may have recorded samples it never produced: inputs come from the host
            ib.pending[[ib.slot_of[r] for r in sub.req_ids]] = -1
            return self.collect(self._launch_rows(sub))

        out = isolate_culprits(so, error, run)
        for rid in out.failed:
            slot = ib.slot_of.get(rid)
            if slot is not None:
                ib.pending[slot] = -1
        return out

    def _launch_rows(self, so: SchedulerOutput) -> LaunchedStep:
        """Enqueue the device work of a step's rows (its changes applied to the persistent batch)."""
        if so.uniform:  # the scheduler marks one only when the drafter has its uniform graphs
            return self._launch_uniform(so)
        speculative = self.drafter is not None and (so.drafting or so.num_draft_tokens)
        if speculative:  # computed whole: the next step's rows depend on its drafts; its inputs come from the host
            self._read_back(self._inflight)
        # a verifying step's logits rows are many per request and it needs the head's features: no decode graph
        b, rows, graph_bs, graph_t, graph_seqs = self._step_inputs(so, decode_graphs=not speculative)
        if speculative:
            return LaunchedStep(so, self._speculative_step(so, b, rows, graph_t, graph_seqs))
        n = len(so.req_ids)
        sample_rows, req_ids = sampling_rows(so)
        num_rows = len(req_ids)
        if so.forks:  # a fork samples with its own parameters (its own slot) from its parent's row
            slots = np.fromiter(map(self.batch.slot_of.__getitem__, req_ids), np.int64, num_rows)
        else:
            slots = rows.slots if num_rows == n else rows.slots[sample_rows]
        positions = rows.starts[sample_rows] + rows.q_lens[sample_rows] - 1
        rank0 = self.samples
        if self.batch.penalized[slots].any():
            self._read_back(self._inflight)  # penalties count every output token: the one in flight too
        sampling = self.sampling.build(slots, self.batch.num_outputs(slots, positions), b) if rank0 else None
        whole = graph_bs is not None and num_rows == n and not so.forks  # every row samples, in order
        gather = rows.gather_dst.size
        if gather:
            b.gather_src_np[:gather] = rows.gather_src
            b.gather_dst_np[:gather] = rows.gather_dst
        if graph_bs is not None:
            if not whole and num_rows:
                b.logit_rows_np[:num_rows] = sample_rows
            b.upload(graph_bs, graph_bs, b.max_blocks, 0 if whole else num_rows, gather)
        else:
            head_rows = self._head_rows(num_rows)
            if num_rows:
                b.logit_rows_np[:num_rows] = rows.query_start_loc[1:][sample_rows] - 1
                b.logit_rows_np[num_rows:head_rows] = 0  # padding: any row of this step
            if graph_t is not None:
                b.upload(graph_t, graph_seqs, b.max_blocks, head_rows, gather)
            else:
                b.upload(rows.num_tokens, n, b.max_blocks, head_rows, gather)
        if gather:  # decodes whose input token the step in flight sampled: copied from its samples on the device
            b.input_ids[b.gather_dst[:gather]] = self._last_sampled[b.gather_src[:gather]]
        prepared_at = time.perf_counter()
        started = self.rings.event()  # the device's time on the step: from its forward on
        if graph_bs is not None:
            logits = self.graphs.replay(graph_bs)
            if num_rows == 0:
                return LaunchedStep(so, ModelOutput(so.step_id))
            logits = logits[:n] if whole else logits[b.logit_rows[:num_rows]]
        else:
            if graph_t is not None:
                hidden, _ = self.replay_mixed(graph_t)
            else:
                t = rows.num_tokens
                hidden = self._forward(b.input_ids[:t], b.positions[:t], attention_metadata(rows, b))
            if num_rows == 0:
                return LaunchedStep(so, ModelOutput(so.step_id))
            logits = self.model.compute_logits(hidden[b.logit_rows[:head_rows]])[:num_rows]
        eager = graph_bs is None and graph_t is None
        step = LaunchedStep(so, req_ids=req_ids, slots=slots, prepared_at=prepared_at, started=started, eager=eager)
        if rank0:
            step.grammar_rows = self._mask_constrained(logits, req_ids, slots)
        if not rank0:
            tokens = torch.empty(num_rows, dtype=torch.long, device=self.device)
        elif sampling is None:  # every row greedy, no penalties, bans or logprobs
            tokens = argmax_rows(logits)
        else:
            step.sampler_out = sample(logits, sampling)
            tokens = step.sampler_out.token_ids
        step.enqueued_at = time.perf_counter()
        if self.tp is not None:
            self.tp.broadcast(tokens)
        self.batch.sampled(slots, so.step_id, np.arange(num_rows))
        self._enqueue_read_back(step, tokens)
        self._last_sampled = tokens
        return step

    def _mask_constrained(self, logits: torch.Tensor, req_ids: list[str], slots: np.ndarray) -> np.ndarray | None:
        """Mask the logits of a step's constrained sampling rows in place (their indices are returned, for the
        read-back to advance their matchers); None, and nothing done, when no row is constrained.

        The step's forward is enqueued already: the step before it is read back now (its tokens advance the
        matchers), and the mask is filled on the host while the device runs this step's forward. The mask
        reaches the device without a sync, ahead of the sampling kernels on the same stream."""
        if not self.grammar.matchers:
            return None
        rows = np.flatnonzero(self.batch.structured[slots])
        if not rows.size:
            return None
        self._read_back(self._inflight)
        self.grammar.mask_logits(logits, [req_ids[j] for j in rows.tolist()], rows)
        return rows

    def _mask_verifying(self, logits: torch.Tensor, spec: SpecRows) -> None:
        """A speculative step's constrained sampling rows (every step before it is read back): a verification
        row's mask is the grammar's after the drafts before it, so a draft the grammar rejects is rejected by
        verification, and the token that replaces it is one the grammar allows."""
        if not self.grammar.matchers:
            return
        ib = self.batch
        rows = np.flatnonzero(ib.structured[spec.slots])
        if rows.size:
            rids = [ib.req_ids[s] for s in spec.slots[rows].tolist()]
            self.grammar.mask_logits(logits, rids, rows, [spec.extra_outputs[i] for i in rows.tolist()])

    def _step_inputs(
        self, so: SchedulerOutput, decode_graphs: bool
    ) -> tuple[StepBuffers, StepRows, int | None, int | None, int | None]:
        """Every step's inputs, written by the one step-input builder into the step buffers, padded for the graph
        the step replays: a decode graph (batch size ``graph_bs``) for a step of decodes only, else a mixed-step
        graph (``graph_t`` tokens, ``graph_seqs`` sequences) if one fits, else none (eager)."""
        n = len(so.req_ids)
        num_tokens = so.num_tokens
        b = self.buffers
        graph_bs = graph_t = graph_seqs = None
        if decode_graphs and self.graphs is not None and num_tokens == n:
            graph_bs = self.graphs.padded_size(n)
        # steps with prefill rows (and decodes past the decode graphs' sizes): a mixed-step graph, if one fits
        if graph_bs is None and self.mixed_graphs is not None:
            graph_t = self.mixed_graphs.padded_size(num_tokens)
        if num_tokens > b.max_tokens or n > b.max_seqs:
            # larger than the scheduler's limits promise (never in normal use): a one-off eager buffer
            b = StepBuffers(num_tokens, n, self.max_blocks_per_seq, self.device)
            graph_bs = graph_t = None
        b.wait_uploaded()  # the last step's inputs have left the pinned buffers
        if graph_t is not None:
            graph_seqs = self.mixed_graphs.num_seqs(graph_t)
            rows = self.batch.build(so, b, graph_seqs, graph_t)
        else:
            rows = self.batch.build(so, b, graph_bs)
        return b, rows, graph_bs, graph_t, graph_seqs

    def _launch_uniform(self, so: SchedulerOutput) -> LaunchedStep:
        """A uniform speculative step: the drafter's captured forward (verification and drafting without a host
        sync), read back like a plain step. Its inputs come from the host (every step before it read back) or
        from the device (`SchedulerOutput.device_fed`)."""
        slots, bs = self.drafter.prepare_uniform(so, self.batch)
        step = LaunchedStep(so, req_ids=so.req_ids, slots=slots, uniform=True, prepared_at=time.perf_counter())
        step.started = self.rings.event()
        self._enqueue_read_back(step, self.drafter.run_uniform(bs))
        return step

    def _speculative_step(
        self, so: SchedulerOutput, b: StepBuffers, rows: StepRows, graph_t: int | None, graph_seqs: int | None
    ) -> ModelOutput:
        """The rest of a step that verifies or drafts (its inputs built), computed whole: the target over every
        row (a mixed-step graph when one fits: it keeps the head's features too), the plain rows sampled and the
        drafter's verification rows checked in one host sync, then the next drafts."""
        ib, drafter = self.batch, self.drafter
        sample_idx, req_ids = sampling_rows(so)
        spec = drafter.rows_to_verify(so, rows, sample_idx, req_ids, ib)
        batch = self.sampling.build(spec.slots, spec.num_outputs, b, spec.extra_outputs) if len(spec.slots) else None
        if graph_t is not None:
            b.upload(graph_t, graph_seqs, b.max_blocks, 0)
            hidden, features = self.replay_mixed(graph_t)
        else:
            t = rows.num_tokens
            b.upload(t, len(so.req_ids), b.max_blocks, 0)
            hidden, features = self.target(b.input_ids[:t], b.positions[:t], attention_metadata(rows, b))
        host, plain_out = self._sample_and_verify(hidden, spec, batch, req_ids)
        out, sampled, spec_tokens = drafter.step_output(so, req_ids, spec, host, ib)
        if self.grammar.matchers:
            self.grammar.accept_step(sampled, spec_tokens)
        if plain_out is not None and plain_out.logprobs is not None:
            p = len(spec.plain)
            lps = token_logprobs(ib.num_logprobs[spec.slots[:p]].tolist(), host[:p], plain_out)
            out.logprobs = [None] * len(req_ids)
            for j, lp in zip(spec.plain, lps):
                out.logprobs[j] = lp
        out.draft_token_ids = drafter.propose(
            so, rows, b.input_ids_np, features, sampled, spec_tokens, ib, self.generators
        )
        return out

    def _sample_and_verify(
        self, hidden: torch.Tensor, spec: SpecRows, batch: SamplingBatch | None, req_ids: list[str]
    ) -> tuple[list[int], SamplerOutput | None]:
        """A speculative step's tokens on the host (its one sync for the target): the plain rows' samples, then
        the verifying rows' emitted tokens ``[rows, max d + 1]`` and accepted counts; and the plain rows'
        sampler output (logprobs)."""
        if not spec.logit_rows:
            return [], None
        logits = self.model.compute_logits(hidden[torch.tensor(spec.logit_rows, device=self.device)]).float()
        self._mask_verifying(logits, spec)
        p = len(spec.plain)
        parts: list[torch.Tensor] = []
        plain_out = None
        if spec.plain:
            if batch is None:
                parts.append(argmax_rows(logits[:p]))
            else:
                plain_out = sample(logits[:p], batch.select(0, p))
                parts.append(plain_out.token_ids)
        if spec.verify:
            vb = batch.select(p, len(spec.slots)) if batch is not None else None
            verifying = [req_ids[j] for j in spec.verify]
            res = self.drafter.verify(
                logits[p:], vb, verifying, spec.slots[p:], spec.drafts_of, self.batch, self.generators
            )
            parts += [res.output_token_ids.flatten(), res.num_accepted]
        return torch.cat(parts).tolist(), plain_out

    def _head_rows(self, num_rows: int) -> int:
        """Rows the LM head computes for a step outside the decode graphs: ``num_rows`` padded to a decode graph's
        batch size. The head's matmul then has a row count the graphs' capture ran, so cuBLAS picks a kernel that
        is loaded already. CUDA loads a kernel at its first launch, and loading one may wait for the device to
        finish what is queued: the likely cause of the launches in a burst's first steps that lasted as long as
        their step's device work (docs/benchmarks.md). ``SLUICE_PAD_HEAD_ROWS=0`` computes the rows as they are."""
        if self.graphs is None or not num_rows or not self._pad_head_rows:
            return num_rows
        return self.graphs.padded_size(num_rows) or num_rows

    def _enqueue_read_back(self, step: LaunchedStep, tokens: torch.Tensor) -> None:
        """The step's tokens on their way to pinned host memory; it is the step in flight until read back."""
        step.tokens = tokens
        if self.rings.on_device:
            step.host_tokens = self.rings.host_tokens(tokens.numel())
            step.host_tokens.copy_(tokens, non_blocking=True)
            step.ready = self.rings.event()
        self._inflight = step

    def collect(self, step: LaunchedStep) -> ModelOutput:
        """Wait for a launched step's tokens; its output for the scheduler, with the requests whose grammar failed
        since the last one (they fail alone) and the host's time on grammar masks since then."""
        out = self._collect(step)
        failed = self.grammar.take_failures()
        if failed:
            out.failed = {**(out.failed or {}), **failed}
        if self.grammar.fill_seconds:
            out.grammar_mask_s, self.grammar.fill_seconds = self.grammar.fill_seconds, 0.0
        return out

    def _collect(self, step: LaunchedStep) -> ModelOutput:
        if step.output is not None:
            return step.output
        self._read_back(step)
        if step.uniform:
            return step.output
        if self.tp is not None and self.tp.rank != 0:
            return ModelOutput(step.so.step_id)
        logprobs = None
        if step.sampler_out is not None and step.sampler_out.logprobs is not None:
            logprobs = token_logprobs(self.batch.num_logprobs[step.slots].tolist(), step.token_list, step.sampler_out)
        return ModelOutput(step.so.step_id, step.req_ids, step.token_list, logprobs)

    def _read_back(self, step: LaunchedStep | None) -> None:
        """The host side of a step's samples: the persistent batch learns its tokens (once)."""
        if step is None or step.read or step.output is not None:
            return
        step.read = True
        if step.ready is not None:
            t0 = time.perf_counter()
            step.ready.synchronize()
            step.waited_s = time.perf_counter() - t0
            host = step.host_tokens.numpy()
        else:
            host = step.tokens.numpy()
        if step.uniform:
            step.output = self.drafter.uniform_output(step.so, step.slots, host, self.batch)
            if self._inflight is step:
                self._inflight = None
            return
        self.batch.read_back(step.slots, step.so.step_id, host)
        step.token_list = host.tolist()
        if step.grammar_rows is not None:
            self.grammar.accept_rows(step.req_ids, step.token_list, step.grammar_rows)
        ib = self.batch
        if ib.penalized[step.slots].any():
            for slot, t in zip(step.slots.tolist(), step.token_list):
                out = ib.output_tokens[slot]
                if out is not None:
                    out.append(t)
        if self._inflight is step:
            self._inflight = None

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward over a step's tokens: final hidden states (what a mixed-step graph captures)."""
        return self.model(input_ids, positions, ForwardContext(meta, self.kv_caches, self.backend))

    def mixed_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """What a mixed-step graph captures: the final hidden states, and with an EAGLE-3 draft head its features
        beside them (``[T, hidden + features]``), so that a step that drafts (a prompt's last chunk) replays it too."""
        if self.drafter is None or not self.drafter.feature_layers:
            return self._forward(input_ids, positions, meta)
        return torch.cat(self.target(input_ids, positions, meta), -1)

    def replay_mixed(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the mixed-step graph of ``size`` tokens: its final hidden states and the draft head's features
        (the hidden states themselves without EAGLE-3 layers)."""
        out = self.mixed_graphs.replay(size)
        h = self.model.config.hidden_size
        return (out[:, :h], out[:, h:]) if out.shape[-1] > h else (out, out)

    def _decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """The captured part of a decode step: embedding to logits of every row."""
        return self.model.compute_logits(self._forward(input_ids, positions, meta))


_PROFILE_PARAMS = SamplingParams(temperature=0)
