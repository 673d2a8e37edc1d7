"""Sizing the KV pool on a GPU from a memory profile: what is left of ``gpu_memory_utilization`` of the card
once the weights, the largest step's activations, memory outside torch and the graphs' pool are counted."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from sluice.core.args import EngineArgs

logger = logging.getLogger("sluice")

GiB = 1024**3
# Room left beside the KV pool for the graphs' memory pool (activations of the largest captured step, the
# decode graphs' logits), which is allocated after the pool is sized.
GRAPH_POOL_RESERVE = GiB


def largest_step_lens(max_num_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the largest step the scheduler can send: all of ``max_num_batched_tokens`` as prefill,
    in as few sequences as ``max_model_len`` allows (no step holds more than ``max_num_seqs`` sequences of
    ``max_model_len`` tokens, and the step buffers bound the profile's own batch too)."""
    n_tok = min(max_num_tokens, max_num_seqs * max_model_len)
    n_seq = max(1, -(-n_tok // max_model_len))
    return [n_tok // n_seq + (1 if i < n_tok % n_seq else 0) for i in range(n_seq)]


@torch.inference_mode()
def profile_kv_blocks(
    device: torch.device,
    args: EngineArgs,
    bytes_per_block: int,
    run_largest_step: Callable[[], tuple[int, int, int]],
) -> int:
    """Size the KV pool from a profiling run: ``run_largest_step`` runs the largest step the scheduler can send
    (all of ``max_num_batched_tokens`` as prefill) and sampling at ``max_num_seqs`` rows with top-p over a
    temporary KV pool it allocates, and returns ``(tokens, sampled rows, the temporary pool's bytes)``; its
    peak allocated memory is the step's. Then ``gpu_memory_utilization`` of the card minus weights, that peak,
    memory outside torch, and a reserve for the graphs; the rest is cut into blocks."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    n_tok, n_rows, tmp_bytes = run_largest_step()  # the temporary pool is freed on return
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    activations = max(0, peak - weights - tmp_bytes)
    reserve = 0 if args.enforce_eager else GRAPH_POOL_RESERVE
    budget = total * args.gpu_memory_utilization - weights - activations - non_torch - reserve
    blocks = int(budget // bytes_per_block)
    logger.info(
        "memory profile: card %.1f GiB x %.2f; weights %.2f GiB, peak activations %.2f GiB (step of %d tokens, "
        "sampling %d rows), outside torch %.2f GiB, graph reserve %.2f GiB -> KV budget %.2f GiB",
        total / GiB,
        args.gpu_memory_utilization,
        weights / GiB,
        activations / GiB,
        n_tok,
        n_rows,
        non_torch / GiB,
        reserve / GiB,
        budget / GiB,
    )
    if blocks < 1:
        raise MemoryError(
            f"no room for the KV cache: budget {budget / GiB:.2f} GiB at gpu_memory_utilization="
            f"{args.gpu_memory_utilization} (weights {weights / GiB:.2f} GiB, activations "
            f"{activations / GiB:.2f} GiB)"
        )
    return blocks
