"""Prometheus metrics: what this gateway sees of each request (latencies, token counts, the
parameters asked), and the schedulers' families read from their stats at scrape time
(scheduler_metrics.py; each scheduler writes its stats when asked, just before: a client that
has its whole response reads them current).

Names follow vLLM's (`vllm:num_requests_running` ...) under the `jaxstream:` prefix, with its
bucket bounds (jaxstream/histogram.py). The families observed here are per gateway (Prometheus
sums instances) and labelled `model_name` only; the schedulers' are per data-parallel replica,
labelled `replica` as vLLM labels its engines: sum them for the whole server (but the rates).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.scheduler_metrics import PREFIX, SchedulerFamilies
from jaxstream import protocol
from jaxstream.histogram import ITL_BUCKETS, N_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, one_two_five

# Token-count buckets reach the context length (vLLM: max_model_len); when the configuration does
# not say it (the model's files do, which the gateway never reads), a million tokens.
TOKENS_LIMIT = 1_000_000


class Metrics:
    def __init__(self, model_name: str, replicas: int = 1, max_model_len: int | None = None) -> None:
        self.registry = CollectorRegistry()
        self.schedulers = SchedulerFamilies(model_name, replicas)
        self.registry.register(self.schedulers)
        labels = ("model_name",)
        tokens = one_two_five(max_model_len or TOKENS_LIMIT)
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
                             buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram(PREFIX + "request_prompt_tokens", "Prompt tokens of a finished request",
                                               labels, buckets=tokens, registry=r)
        self.request_generation_tokens = Histogram(PREFIX + "request_generation_tokens",
                                                   "Tokens generated for a finished request", labels, buckets=tokens, registry=r)
        self.max_generation_tokens = Histogram(PREFIX + "request_max_num_generation_tokens",
                                               "The most tokens generated for one of a prompt's n samples", labels,
                                               buckets=tokens, registry=r)
        self.params_n = Histogram(PREFIX + "request_params_n", "The n request parameter", labels, buckets=N_BUCKETS, registry=r)
        self.params_max_tokens = Histogram(PREFIX + "request_params_max_tokens", "The max_tokens request parameter",
                                           labels, buckets=tokens, registry=r)
        self.labels = {"model_name": model_name}

    def group(self, n: int, max_tokens: int | None) -> Group:
        """The n samples of one prompt (vLLM's parent request), observed once all have finished."""
        return Group(self, n, max_tokens)

    async def track(self, outputs: AsyncIterator[protocol.RequestOutput], group: Group) -> AsyncIterator[protocol.RequestOutput]:
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
                    self.request_prompt_tokens.labels(**self.labels).observe(out.prompt_tokens)
                    self.request_generation_tokens.labels(**self.labels).observe(generated)
                    group.finished(generated)
                yield out
        finally:
            if generated:
                self.generation_tokens.labels(**self.labels).inc(generated)
            await outputs.aclose()

    def render(self, scheduler_stats: list[tuple[int, protocol.SchedulerStats]]) -> bytes:
        """The exposition text, the schedulers' families read from the live ones' (replica, stats)."""
        self.schedulers.update(scheduler_stats)
        return generate_latest(self.registry)


class Group:
    def __init__(self, metrics: Metrics, n: int, max_tokens: int | None) -> None:
        self.metrics = metrics
        self.n = n
        self.max_tokens = max_tokens  # None: up to the context (vLLM observes only a given one)
        self.left = n
        self.most = 0

    def finished(self, generated: int) -> None:
        self.left -= 1
        self.most = max(self.most, generated)
        if self.left == 0:
            m = self.metrics
            m.max_generation_tokens.labels(**m.labels).observe(self.most)
            m.params_n.labels(**m.labels).observe(self.n)
            if self.max_tokens is not None:
                m.params_max_tokens.labels(**m.labels).observe(self.max_tokens)
