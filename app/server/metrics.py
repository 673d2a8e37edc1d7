"""Prometheus metrics of one server app, named after vLLM's under the ``sluice:`` prefix.

Engine-wide figures (queue lengths, KV usage, prefix-cache and token counters) are read from
``engine.stats()`` when /metrics is scraped, so they cost nothing per step; latency histograms are
observed per request by the server. Each app owns its `CollectorRegistry`: two apps in one process (or
one test session) never share or clash over metric state.

Several server processes in front of one engine core (`sluice serve --api-server-count N`) use
prometheus-client's multiprocess mode: with ``PROMETHEUS_MULTIPROC_DIR`` set (the supervisor sets it to a
directory of its own), each process's per-request histograms and counters live in files there, and a scrape of
any process reads and sums every process's files. The engine's figures are not summed: every front end
receives the same core's counters, so each reports them as they are. The prefix-cache hit rate over the
recent requests merges the windows of all the processes (`SharedRecentHitRate`).
"""

from __future__ import annotations

import glob
import os
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from sluice.core.outputs import Usage

PREFIX = "sluice:"

# (stats attribute, metric name, help). Counters are exposed with the `_total` suffix.
_GAUGES = (
    ("num_running", "num_requests_running", "Sequences in the running batch."),
    ("num_waiting", "num_requests_waiting", "Sequences waiting to be scheduled."),
    ("kv_blocks_free", "kv_blocks_free", "KV blocks not held by any request (unreferenced cached blocks count)."),
    ("kv_blocks_total", "kv_blocks_total", "KV blocks in the pool."),
)
_COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("num_preemptions", "num_preemptions", "Requests preempted (blocks freed, recomputed later)."),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens admitted."),
    ("generation_tokens", "generation_tokens", "Tokens generated."),
)
_STRUCTURED_COUNTERS = (
    ("structured_requests", "structured_output_requests", "Sequences admitted under a grammar (structured outputs)."),
    ("grammar_mask_seconds", "grammar_mask_seconds", "Host seconds filling and uploading grammar masks."),
    ("grammar_mask_steps", "grammar_mask_steps", "Steps with at least one row under a grammar."),
)
_SPEC_COUNTERS = (
    ("spec_num_drafts", "spec_decode_num_drafts", "Speculative verification steps with at least one draft."),
    ("spec_num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens verified."),
    ("spec_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Draft tokens accepted."),
)

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)

# The hit-rate gauge's window, in requests (vLLM logs its prefix-cache hit rate over the last 1000 too).
HIT_RATE_WINDOW = 1000


class RecentHitRate:
    """Prefix-cache hit rate over the last ``window`` finished requests: the cumulative counters show what a
    deployment did since it started, this shows what it does now (after a prompt change, say)."""

    def __init__(self, window: int = HIT_RATE_WINDOW) -> None:
        self.requests: deque[tuple[int, int]] = deque(maxlen=window)  # (prompt tokens, of them cached)
        self.queries = self.hits = 0

    def add(self, prompt_tokens: int, cached_tokens: int) -> None:
        if len(self.requests) == self.requests.maxlen:
            q, h = self.requests[0]
            self.queries -= q
            self.hits -= h
        self.requests.append((prompt_tokens, cached_tokens))
        self.queries += prompt_tokens
        self.hits += cached_tokens

    @property
    def value(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


# Multiprocess mode: each process's hit-rate window, as gauges summed over the processes; read by
# `SharedRecentHitRate`, never exported themselves.
_WINDOW_QUERIES = PREFIX + "prefix_cache_window_queries"
_WINDOW_HITS = PREFIX + "prefix_cache_window_hits"
_PRIVATE = frozenset((_WINDOW_QUERIES, _WINDOW_HITS))


class SharedRecentHitRate(RecentHitRate):
    """`RecentHitRate` over several server processes: each keeps the window of the requests it served and
    publishes its sums in prometheus-client's multiprocess files (``sum`` gauges); the value is the sum of the
    hits over the sum of the queries, so N processes cover their last ``window`` requests each."""

    def __init__(self, path: str, window: int = HIT_RATE_WINDOW) -> None:
        super().__init__(window)
        self.path = path
        self._queries = Gauge(_WINDOW_QUERIES, "Window: prompt tokens.", multiprocess_mode="sum", registry=None)
        self._hits = Gauge(_WINDOW_HITS, "Window: cached tokens.", multiprocess_mode="sum", registry=None)

    def add(self, prompt_tokens: int, cached_tokens: int) -> None:
        super().add(prompt_tokens, cached_tokens)
        self._queries.set(self.queries)
        self._hits.set(self.hits)

    @property
    def value(self) -> float:
        sums = dict.fromkeys(_PRIVATE, 0.0)
        for metric in MultiProcessCollector.merge(glob.glob(os.path.join(self.path, "gauge_sum_*.db"))):
            for sample in metric.samples:
                if sample.name in sums:
                    sums[sample.name] += sample.value
        queries = sums[_WINDOW_QUERIES]
        return sums[_WINDOW_HITS] / queries if queries else 0.0


class _FilesCollector(Collector):
    """Multiprocess mode: what every process wrote to ``path`` (prometheus-client's `MultiProcessCollector`),
    less the hit-rate window's own gauges."""

    def __init__(self, path: str) -> None:
        self.path = path

    def describe(self) -> list[Metric]:
        return []  # its names are not known before a scrape (and never clash with the engine's)

    def collect(self) -> Iterator[Metric]:
        for metric in MultiProcessCollector.merge(glob.glob(os.path.join(self.path, "*.db"))):
            if metric.name not in _PRIVATE:
                yield metric


class _EngineCollector(Collector):
    def __init__(self, engine: Any, recent: RecentHitRate) -> None:
        self.engine = engine
        self.recent = recent

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.engine.stats()
        except Exception:  # an engine that never started has no scheduler yet: export nothing
            return
        for attr, name, doc in _GAUGES:
            yield GaugeMetricFamily(PREFIX + name, doc, value=getattr(stats, attr))
        yield GaugeMetricFamily(
            PREFIX + "kv_cache_usage_perc",
            "Fraction of KV blocks held by requests, 0 to 1 (unreferenced cached blocks count as free).",
            value=stats.kv_cache_usage,
        )
        for attr, name, doc in (*_COUNTERS, *_STRUCTURED_COUNTERS):
            yield CounterMetricFamily(PREFIX + name, doc, value=getattr(stats, attr))
        yield GaugeMetricFamily(
            PREFIX + "prefix_cache_hit_rate",
            f"Prefix-cache hit rate (cached / prompt tokens, 0 to 1) over the last {self.recent.requests.maxlen} "
            f"finished requests{' of each API server' if isinstance(self.recent, SharedRecentHitRate) else ''}.",
            value=self.recent.value,
        )
        per_pos = getattr(stats, "spec_accepted_per_position", ())
        if per_pos:  # speculative decoding is on
            for attr, name, doc in _SPEC_COUNTERS:
                yield CounterMetricFamily(PREFIX + name, doc, value=getattr(stats, attr))
            fam = CounterMetricFamily(
                PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted at each draft position.",
                labels=["position"],
            )
            for i, n in enumerate(per_pos):
                fam.add_metric([str(i)], n)
            yield fam
        replicas = getattr(self.engine, "replica_stats", None)  # data-parallel replicas (app/ray/): each one's too
        if replicas is not None:
            yield from _per_replica(replicas())
        # The engine's own verdict, not the last published counters': a core that died between steps (its process
        # killed, a worker lost) publishes nothing more, so those would say healthy for good.
        healthy = getattr(self.engine, "is_healthy", stats.healthy)
        yield GaugeMetricFamily(PREFIX + "engine_healthy", "1 while the engine serves requests.", value=int(healthy))


def _per_replica(stats: dict[str, Any]) -> Iterator[Metric]:
    """Each replica's engine figures, labelled by replica, as gauges (``sluice:replica_<name>``)."""
    for attr, name, doc in _GAUGES + _COUNTERS:
        fam = GaugeMetricFamily(PREFIX + "replica_" + name, doc + " Per data-parallel replica.", labels=["replica"])
        for replica, s in stats.items():
            fam.add_metric([replica], getattr(s, attr))
        yield fam


class ServerMetrics:
    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # prometheus-client itself keeps its values in that directory's files when the variable is set
        multiproc_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if multiproc_dir:
            self.recent_hit_rate: RecentHitRate = SharedRecentHitRate(multiproc_dir)
            self.registry.register(_FilesCollector(multiproc_dir))
            r = None  # the per-request metrics are read back from the files, every process's
        else:
            self.recent_hit_rate = RecentHitRate()
            r = self.registry
        self.registry.register(_EngineCollector(engine, self.recent_hit_rate))
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Arrival to first token.", buckets=_TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between successive outputs of one sequence.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival to last token.", buckets=_E2E_BUCKETS, registry=r
        )
        self.request_success = Counter(
            PREFIX + "request_success", "Finished sequences by finish reason.", ["finished_reason"], registry=r
        )
        self.grammar_compile = Histogram(
            PREFIX + "grammar_compile_seconds",
            "Checking a request's structured output (JSON schema, regex, grammar) against the tokenizer.",
            buckets=_COMPILE_BUCKETS,
            registry=r,
        )
        if hasattr(engine, "on_grammar_compile"):
            engine.on_grammar_compile = self.grammar_compile.observe

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTracker:
    """Observes one request's latencies as its outputs go by (all n sequences of it)."""

    __slots__ = ("metrics", "arrival", "first", "last")

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.first = False
        self.last: dict[int, float] = {}

    def observe(self, index: int, finish_reason: str | None) -> None:
        now = time.monotonic()
        if not self.first:
            self.first = True
            self.metrics.ttft.observe(now - self.arrival)
        prev = self.last.get(index)
        if prev is not None:
            self.metrics.itl.observe(now - prev)
        self.last[index] = now
        if finish_reason is not None:
            self.metrics.request_success.labels(finish_reason).inc()

    def done(self, usage: Usage | None) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
        if usage is not None:
            self.metrics.recent_hit_rate.add(usage.prompt_tokens, usage.cached_tokens)
