"""The engine's counters as of its last step: what `AsyncEngine.stats()` returns and the metrics endpoint
reads; they cross the process bridge with every step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    num_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    healthy: bool = True
    # speculative decoding (mean acceptance length = 1 + accepted / drafts)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # structured outputs: sequences admitted under a grammar; the host's time filling (and uploading) the grammar
    # masks of constrained rows, and the steps that had any
    structured_requests: int = 0
    grammar_mask_seconds: float = 0.0
    grammar_mask_steps: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens per verification step: the accepted drafts plus the one the target always adds."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0
