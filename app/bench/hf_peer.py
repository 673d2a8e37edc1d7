"""The Hugging Face transformers peer: the same requests, run through transformers' continuous batching (or a
static-batch `generate`), with forced output lengths, so that sluice's figures have a reference to stand
beside.

`load_hf_model` accepts every model source sluice does (`core.models.loader.resolve_model`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from sluice.app.bench.datasets import BenchRequest
from sluice.core import envs
from sluice.core.frontend.tokenizer import load_tokenizer
from sluice.core.models.loader import resolve_model
from sluice.core.models.registry import DEFAULT_MODEL

DUMMY_INIT_STD = 0.02
DUMMY_SEED = 0
# Tokens per forward step of the continuous-batching peer on a CPU when not given: what transformers 5.25 picks
# there. 5.17 instead solves it from host RAM (tens of thousands, and a step's attention mask grows with its
# square: a run of four tiny requests took 50 s instead of 2).
CPU_MAX_BATCH_TOKENS = 8192


# ------------------------------------------------------------------------------------------------ loading


def init_dummy_weights(model: torch.nn.Module, seed: int = DUMMY_SEED, std: float = DUMMY_INIT_STD) -> None:
    """Deterministic random weights: every matrix from normal(0, std), every vector (the RMS norms) ones."""
    params = list(model.named_parameters())
    if not params:
        return
    gen = torch.Generator(device=params[0][1].device).manual_seed(seed)
    with torch.no_grad():
        for _, p in params:
            if p.dim() >= 2:
                p.normal_(0.0, std, generator=gen)
            else:
                p.fill_(1.0)


def load_hf_model(model: str = DEFAULT_MODEL, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """A transformers causal LM (SDPA attention, eval mode) for any model source sluice accepts; the source
    is resolved by sluice's own loader (a GGUF file is read through its converted Hugging Face folder)."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    source = resolve_model(model, envs.SLUICE_CACHE_DIR)
    if source.weights_dir is None:
        with torch.device(device):
            m = AutoModelForCausalLM.from_config(source.config, dtype=dtype, attn_implementation="sdpa")
        init_dummy_weights(m)
        return m.eval()
    m = AutoModelForCausalLM.from_pretrained(source.weights_dir, dtype=dtype, attn_implementation="sdpa")
    return m.to(device).eval()


def load_hf_tokenizer(model: str = DEFAULT_MODEL):
    """The tokenizer of `model` (dummy models borrow the default model's)."""
    return load_tokenizer(resolve_model(model, envs.SLUICE_CACHE_DIR).tokenizer_dir)


# ------------------------------------------------------------------------------------------------ results


@dataclass
class PeerResult:
    name: str
    num_requests: int
    num_finished: int
    output_tokens: int
    elapsed_s: float
    output_tokens_per_s: float
    requests_per_s: float
    total_tokens_per_s: float
    prompt_tokens: int = 0
    # per request, in input order: output tokens produced (0 when the request did not finish)
    output_lens: list[int] = field(default_factory=list, repr=False)
    error: str | None = None  # why requests failed: the generation loop's fatal error, else the first request's
    timed_out: bool = False  # the time limit ended the run before every request finished
    timeout_s: float | None = None

    @property
    def incomplete_reason(self) -> str | None:
        """None when every request finished; otherwise why not. A peer that did not finish every request ran a
        different workload, so its throughput stands beside no other run's."""
        if self.num_finished == self.num_requests and self.error is None:
            return None
        done = f"{self.num_finished} of {self.num_requests} finished"
        if self.error is not None:
            return f"{done}: {self.error}"
        if self.timed_out and self.timeout_s is not None:
            return f"{done} within the {self.timeout_s:g} s limit"
        return done

    @classmethod
    def build(
        cls,
        name: str,
        requests: Sequence[BenchRequest],
        output_lens: list[int],
        finished: list[bool],
        elapsed_s: float,
        *,
        error: str | None = None,
        timed_out: bool = False,
        timeout_s: float | None = None,
    ) -> PeerResult:
        out = sum(output_lens)
        prompt = sum(len(r.prompt_token_ids) for r, f in zip(requests, finished, strict=True) if f)
        done = sum(finished)
        el = max(elapsed_s, 1e-9)
        return cls(
            name=name,
            num_requests=len(requests),
            num_finished=done,
            output_tokens=out,
            elapsed_s=elapsed_s,
            output_tokens_per_s=out / el,
            requests_per_s=done / el,
            total_tokens_per_s=(prompt + out) / el,
            prompt_tokens=prompt,
            output_lens=output_lens,
            error=error,
            timed_out=timed_out,
            timeout_s=timeout_s,
        )

    def figures(self) -> dict:
        """The scalar figures (everything but the per-request lengths), for result files and tables."""
        d = dataclasses.asdict(self)
        d.pop("output_lens")
        return d


# ------------------------------------------------------------------------------------------------ peers


def _cb_num_blocks(requests: Sequence[BenchRequest], page_size: int) -> int:
    """Enough cache blocks for every request to be resident at once (plus slack), so the peer is not limited
    by a cache sized from host RAM (transformers sizes it to 90% of memory on CPU)."""
    blocks = sum(-(-(len(r.prompt_token_ids) + r.output_len) // page_size) for r in requests)
    return blocks + 2


def _cb_config(cls, **kwargs):
    """A ContinuousBatchingConfig across transformers versions: 5.17 (the GPU machine's) calls the page size
    ``block_size`` and has no ``auto_switch_to_flash`` (it switches to a paged attention by itself)."""
    names = {f.name for f in dataclasses.fields(cls)}
    if "page_size" not in names and "block_size" in names:
        kwargs["block_size"] = kwargs.pop("page_size")
    return cls(**{k: v for k, v in kwargs.items() if k in names})


def run_hf_continuous_batching(
    model,
    requests: Sequence[BenchRequest],
    max_batch_tokens: int | None = None,
    timeout_s: float = 600.0,
    *,
    num_blocks: int | None = None,
    page_size: int = 256,
    allow_block_sharing: bool = True,
    name: str = "hf-continuous-batching",
) -> PeerResult:
    """Run `requests` through transformers' continuous batching manager with forced output lengths (EOS
    disabled, greedy). Wall time runs from the first `add_request` to the last result (the cache is allocated
    and the loop started before). Requests not finished within `timeout_s` count as unfinished (their tokens
    are not counted, the elapsed time runs to the timeout, and the result says `timed_out`); a failed request
    or a dead generation loop leaves its message in `error`.

    `max_batch_tokens` caps the tokens per forward step (None: transformers sizes it on a GPU, and on a CPU it is
    `CPU_MAX_BATCH_TOKENS`); `num_blocks` defaults to room for every request at once on a CPU (on a GPU, pass it
    to bound the cache)."""
    if not requests:
        return PeerResult.build(name, [], [], [], 0.0)
    manager = _cb_manager(model, requests, max_batch_tokens, num_blocks, page_size, allow_block_sharing)
    ids = [f"req_{i}" for i in range(len(requests))]
    index = {rid: i for i, rid in enumerate(ids)}
    got = _CBResults(len(requests))
    # No inference mode here: transformers 5.17 runs its generation thread outside it (later versions copy the
    # caller's mode into the thread), and the thread's first act resets, in place, the batch processor `warmup`
    # built: tensors made under inference mode cannot be updated outside it.
    with torch.no_grad():
        manager.warmup()  # allocates the cache (and captures graphs on GPU) before the clock starts
        manager.start()
        try:
            t0 = time.perf_counter()
            deadline = t0 + timeout_s
            for rid, r in zip(ids, requests, strict=True):
                manager.add_request(
                    input_ids=list(r.prompt_token_ids),
                    request_id=rid,
                    max_new_tokens=r.output_len,
                    eos_token_id=-1,
                )
            got.t_last = t0
            got.collect(manager, index, deadline)
            # all done: first add to last result; otherwise (timeout, dead loop) until we gave up
            elapsed = (got.t_last if not got.remaining else time.perf_counter()) - t0
            timed_out = bool(got.remaining) and time.perf_counter() >= deadline
        finally:
            manager.stop(block=True, timeout=30.0, hard_stop=True)
            manager.destroy()
    fatal = getattr(manager.background_thread_status, "fatal_error", None)
    error = f"{type(fatal).__name__}: {fatal}" if fatal is not None else got.first_error
    if error is None and got.remaining and not timed_out:
        error = "the generation loop stopped before every request finished"
    return PeerResult.build(
        name, requests, got.output_lens, got.finished, elapsed, error=error, timed_out=timed_out, timeout_s=timeout_s
    )


def _cb_manager(
    model,
    requests: Sequence[BenchRequest],
    max_batch_tokens: int | None,
    num_blocks: int | None,
    page_size: int,
    allow_block_sharing: bool,
):
    """transformers' continuous batching manager for ``requests`` (greedy, EOS disabled), not yet started."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    max_out = max(r.output_len for r in requests)
    gen_cfg = GenerationConfig(max_new_tokens=max_out, eos_token_id=-1, do_sample=False)
    on_cpu = model.device.type == "cpu"
    if on_cpu and max_batch_tokens is None:
        max_batch_tokens = CPU_MAX_BATCH_TOKENS
    cb_cfg = _cb_config(
        ContinuousBatchingConfig,
        page_size=page_size,
        max_batch_tokens=max_batch_tokens,
        num_blocks=num_blocks if num_blocks is not None else (_cb_num_blocks(requests, page_size) if on_cpu else None),
        allow_block_sharing=allow_block_sharing,
        auto_switch_to_flash=not on_cpu,
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
        max_generated_length=max_out,
        num_requests=len(requests),
    )
    return model.init_continuous_batching(
        generation_config=gen_cfg, continuous_batching_config=cb_cfg, workload_hints=hints
    )


class _CBResults:
    """The continuous batching manager's results as they come: per request, finished or not and its output
    length; the first error; how many are still out and when the last one came."""

    def __init__(self, n: int) -> None:
        self.output_lens = [0] * n
        self.finished = [False] * n
        self.first_error: str | None = None
        self.remaining = n
        self.t_last = 0.0  # set to the clock's start when the requests go in

    def collect(self, manager, index: dict[str, int], deadline: float) -> None:
        """Take results until every request has one, the deadline passes or the generation thread dies."""
        seen: set[int] = set()
        while self.remaining:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            res = manager.get_result(timeout=min(1.0, left))
            if res is None:
                if not manager.is_running():
                    break  # generation thread died
                continue
            if not res.is_finished() or res.request_id not in index:
                continue
            i = index[res.request_id]
            if i in seen:
                continue
            seen.add(i)
            self.remaining -= 1
            self.t_last = time.perf_counter()
            if res.error is None:
                self.finished[i] = True
                self.output_lens[i] = len(res.generated_tokens)
            elif self.first_error is None:
                self.first_error = str(res.error)


def run_hf_generate(
    model,
    requests: Sequence[BenchRequest],
    batch_size: int,
    *,
    pad_token_id: int = 0,
    name: str = "hf-generate",
) -> PeerResult:
    """Static-batch `generate` peer (greedy, left padding, EOS disabled): requests run in input order,
    `batch_size` at a time; each batch generates its longest output length for every row, and each request is
    credited with exactly its own `output_len` (the extra tokens of shorter rows are wasted work, as in a
    static server).
    Intended for latency-style comparisons on the fixed-length `random` dataset."""
    from transformers import GenerationConfig

    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    device = model.device
    output_lens: list[int] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(requests), batch_size):
            batch = requests[start : start + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, r in enumerate(batch):
                n = len(r.prompt_token_ids)
                ids[row, width - n :] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
                mask[row, width - n :] = 1
            n_new = max(r.output_len for r in batch)
            gen_cfg = GenerationConfig(
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad_token_id,
            )
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen_cfg)
            produced = out.shape[1] - width
            output_lens.extend(min(produced, r.output_len) for r in batch)
    elapsed = time.perf_counter() - t0
    finished = [n == r.output_len for n, r in zip(output_lens, requests, strict=True)]
    return PeerResult.build(name, requests, output_lens, finished, elapsed)
