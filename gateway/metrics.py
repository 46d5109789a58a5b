"""Prometheus metrics: request latencies and token counts seen by this gateway, and the
scheduler's load read from its stats at scrape time (written with its heartbeat, and at once when a
request starts or ends: a client that has its whole response reads them current).

Names follow vLLM's (`vllm:num_requests_running` ...) under the `jaxstream:` prefix. Counters and
histograms are per gateway (Prometheus sums instances); the load gauges (running, waiting, KV
cache usage, prefix hit rate) are per data-parallel replica, labelled `replica` as vLLM labels its
engines: sum them for the whole server (but the rates). A replica whose scheduler is not live reads 0.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxstream import protocol

PREFIX = "jaxstream:"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class Metrics:
    def __init__(self, model_name: str, replicas: int = 1) -> None:
        self.registry = CollectorRegistry()
        self.replicas = replicas
        labels = ("model_name",)
        per_replica = (*labels, "replica")
        r = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests", labels, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens", labels, registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests by finish reason",
                                       (*labels, "finished_reason"), registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between two output tokens", labels,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to last token", labels,
                             buckets=E2E_BUCKETS, registry=r)
        self.running = Gauge(PREFIX + "num_requests_running", "Requests running on the device", per_replica, registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting to run", per_replica, registry=r)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc", "Fraction of KV cache pages in use (0..1)", per_replica,
                              registry=r)
        self.prefix_hit_rate = Gauge(PREFIX + "prefix_cache_hit_rate",
                                     "Prompt tokens served from the prefix cache / prompt tokens (0..1)", per_replica, registry=r)
        self.labels = {"model_name": model_name}

    async def track(self, outputs: AsyncIterator[protocol.RequestOutput]) -> AsyncIterator[protocol.RequestOutput]:
        """`outputs`, passed through, timed: first token, each next token, the whole request."""
        started = last = time.monotonic()
        generated = 0
        try:
            async for out in outputs:
                now = time.monotonic()
                new = len(out.token_ids)
                if new:
                    if generated == 0:
                        self.ttft.labels(**self.labels).observe(now - started)
                    else:
                        # One output per step carries the step's tokens: spread the gap over them.
                        for _ in range(new):
                            self.itl.labels(**self.labels).observe((now - last) / new)
                    generated += new
                    last = now
                if out.finish is not None:
                    self.e2e.labels(**self.labels).observe(now - started)
                    self.prompt_tokens.labels(**self.labels).inc(out.prompt_tokens)
                    self.request_success.labels(**self.labels, finished_reason=out.finish.type).inc()
                yield out
        finally:
            if generated:
                self.generation_tokens.labels(**self.labels).inc(generated)
            await outputs.aclose()

    def render(self, scheduler_stats: list[tuple[int, dict[str, str]]]) -> bytes:
        """The exposition text, with gauges set from the live schedulers' (replica, stats)."""
        for replica in range(self.replicas):
            stats = [s for r, s in scheduler_stats if r == replica]  # none while it is down
            labels = {**self.labels, "replica": str(replica)}
            self.running.labels(**labels).set(_total(stats, "running"))
            self.waiting.labels(**labels).set(_total(stats, "waiting"))
            self.kv_usage.labels(**labels).set(kv_usage(stats))
            self.prefix_hit_rate.labels(**labels).set(prefix_hit_rate(stats))
        return generate_latest(self.registry)


def kv_usage(stats: list[dict[str, str]]) -> float:
    """Pages in use / all pages (0..1): cached pages nobody reads count as free, as they are
    evicted on demand (SGLang's token_usage; vLLM's kv_cache_usage_perc likewise)."""
    pages = _total(stats, "pages_total")
    return (_total(stats, "pages_used") - _total(stats, "pages_evictable")) / pages if pages else 0.0


def prefix_hit_rate(stats: list[dict[str, str]]) -> float:
    """Prompt tokens read from the prefix cache / prompt tokens, since the scheduler started (0..1)."""
    queries = _total(stats, "prefix_cache_queries_total")
    return _total(stats, "prefix_cache_hits_total") / queries if queries else 0.0


def _total(stats: list[dict[str, str]], key: str) -> int:
    return sum(int(float(s.get(key, 0))) for s in stats)  # stats travel as strings
