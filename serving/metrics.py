"""Prometheus metrics under vLLM's names with a `tunix_rt:` prefix.

Engine-wide numbers (running / waiting requests, KV usage, prefix cache, preemptions, token totals)
are read from `Engine.stats()` at scrape time by a collector; per-request latencies are observed
by the handlers into histograms. Each server owns its registry, so tests can run several.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tunix_rt.engine.engine import EngineStats

PREFIX = "tunix_rt:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class _EngineCollector:
    def __init__(self, stats: Callable[[], EngineStats | None], warming_up: Callable[[], bool], model_name: str):
        self._stats = stats
        self._warming_up = warming_up
        self._labels = {"model_name": model_name}

    def collect(self):
        stats = self._stats()
        if stats is None:  # still loading
            return
        names, values = list(self._labels), list(self._labels.values())

        def gauge(name, doc, value):
            family = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name, doc, value):
            family = CounterMetricFamily(PREFIX + name, doc, labels=names)
            family.add_metric(values, value)
            return family

        yield gauge("num_requests_running", "Sequences in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", stats.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", stats.kv_cache_usage)
        yield gauge("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / tokens looked up.",
                    stats.prefix_cache_hit_rate)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", stats.prefix_cache_hits)
        yield counter("num_preemptions", "Sequences preempted (to be recomputed) for lack of KV blocks.",
                      stats.num_preemptions)
        yield counter("prompt_tokens", "Prompt tokens received.", stats.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed by speculative decoding.",
                      stats.spec_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens the target model accepted.",
                      stats.spec_accepted_tokens)
        yield counter("compiles", "Engine step programs compiled (a lone request's before /health is ready, "
                      "batched steps' while the engine is idle, request options' beside it).", stats.num_compiles)
        yield gauge("warmup_pending", "1 while batched steps' programs are left to compile when the engine is idle.",
                    float(self._warming_up()))


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats | None], model_name: str,
                 warming_up: Callable[[], bool] = lambda: False):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, warming_up, model_name))
        labels = ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time from arrival to the first token.",
                              labels, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between successive output tokens.",
                             labels, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.",
                             labels, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                [*labels, "finished_reason"], registry=self.registry)
        self._model_name = model_name

    def finished(self, reason: str) -> None:
        self._success.labels(self._model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SequenceTimer:
    """Latencies of one generated sequence: TTFT at its first token, ITL for each later one."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self._metrics = metrics
        self._arrival = arrival
        self._last: float | None = None

    def tokens(self, count: int, now: float) -> None:
        if count <= 0:
            return
        if self._last is None:
            self._metrics.ttft.observe(now - self._arrival)
            gaps = [0.0] * (count - 1)  # tokens that came with the first one
        else:  # tokens that arrive together share the gap since the previous ones
            gaps = [(now - self._last) / count] * count
        for gap in gaps:
            self._metrics.itl.observe(gap)
        self._last = now

    def done(self, reason: str, now: float) -> None:
        self._metrics.e2e.observe(now - self._arrival)
        self._metrics.finished(reason)
