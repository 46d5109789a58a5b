"""The scheduler's cumulative counters and histograms, for /metrics (vLLM's families).

The pure core counts as it plans and absorbs; the service writes `stats()` into its heartbeat's hash
(jaxstream/histogram.py says how a histogram travels), and the gateway renders them per replica.
Times are the caller's clock, handed to the core with each call: the core reads none.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from jaxstream.histogram import ITERATION_TOKENS_BUCKETS, REQUEST_LATENCY_BUCKETS, Histogram
from scheduler_svc.request import Request


@dataclass
class Counters:
    """Cumulative, for /metrics: they only grow."""

    requests_total: int = 0  # requests accepted by `add`
    prompt_tokens_total: int = 0  # prompt tokens fed for the first time (a recompute is not counted)
    generation_tokens_total: int = 0  # sampled tokens absorbed
    aborted_total: int = 0  # requests ended by `abort`
    preempted_total: int = 0  # retractions
    prefix_cache_queries_total: int = 0  # prompt tokens of requests fed for the first time
    prefix_cache_hits_total: int = 0  # of them, those taken from the prefix cache
    # Speculative decoding (core.py 8.), vLLM's counters: drafts verified, their tokens, those accepted
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    # vLLM's request phases, observed when a request ends by its finish rule (not by an abort):
    # queue = arrival to first planned step, prefill = to first token, decode = first token to the
    # end, inference = first planned step to the end.
    request_queue_time_seconds: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    request_prefill_time_seconds: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    request_decode_time_seconds: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    request_inference_time_seconds: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    iteration_tokens_total: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKENS_BUCKETS))  # per result, as vLLM

    def stats(self) -> dict[str, int | str]:
        out: dict[str, int | str] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out.update(value.stats(f.name) if isinstance(value, Histogram) else {f.name: value})
        return out

    def acceptance_rate(self) -> float:
        """Draft tokens accepted / draft tokens verified (0 before any)."""
        drafted = self.spec_decode_num_draft_tokens_total
        return round(self.spec_decode_num_accepted_tokens_total / drafted, 4) if drafted else 0.0

    def ended(self, req: Request, now: float) -> None:
        """Observe the phases of a request that ended by its finish rule at `now`. One ended before
        it ever ran (too long for the whole pool) or before it sampled counts the missing phase as 0."""
        scheduled = now if req.scheduled < 0 else req.scheduled
        first = now if req.first_token < 0 else req.first_token
        self.request_queue_time_seconds.observe(max(scheduled - req.arrived, 0.0))
        self.request_prefill_time_seconds.observe(max(first - scheduled, 0.0))
        self.request_decode_time_seconds.observe(max(now - first, 0.0))
        self.request_inference_time_seconds.observe(max(now - scheduled, 0.0))

