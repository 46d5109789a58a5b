"""The Prometheus families read from the schedulers' stats, one series per data-parallel replica
(labelled `replica`, as vLLM labels its engines `engine`): load gauges, the prefix cache's and
preemption counters, and the histograms only a scheduler can time (a request's queue, prefill,
decode and inference phases; tokens per step), which it keeps as cumulative bucket counts
(jaxstream/histogram.py).

A collector, not prometheus_client metrics that the gateway sets: the values are the
schedulers' (cumulative since each started; a restarted scheduler starts again at 0, which
Prometheus reads as a counter reset), taken afresh for each scrape. A replica whose scheduler is
not live reads 0 in the load gauges and has no counter or histogram series until it is back.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from jaxstream import histogram
from jaxstream.histogram import ITERATION_TOKENS_BUCKETS, REQUEST_LATENCY_BUCKETS
from jaxstream.protocol import SchedulerStats

PREFIX = "jaxstream:"
LABELS = ("model_name", "replica")
COUNTERS = (  # (family, stats field, help)
    ("prefix_cache_queries", "prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens"),
    ("prefix_cache_hits", "prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens"),
    ("num_preemptions", "preempted_total", "Cumulative number of preemptions (requests retracted when KV pages ran out)"),
    ("spec_decode_num_drafts", "spec_decode_num_drafts_total", "Speculative decoding: drafts verified"),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens_total", "Speculative decoding: draft tokens verified"),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_total", "Speculative decoding: draft tokens accepted"),
)
HISTOGRAMS = (  # (family = stats name, bounds, help)
    ("request_queue_time_seconds", REQUEST_LATENCY_BUCKETS, "Time from reaching the scheduler to the first planned step"),
    ("request_prefill_time_seconds", REQUEST_LATENCY_BUCKETS, "Time from the first planned step to the first token"),
    ("request_decode_time_seconds", REQUEST_LATENCY_BUCKETS, "Time from the first token to the last"),
    ("request_inference_time_seconds", REQUEST_LATENCY_BUCKETS, "Time from the first planned step to the last token"),
    ("iteration_tokens_total", ITERATION_TOKENS_BUCKETS,
     "Tokens per step as vLLM counts them: the prompts it completed (whole, cached tokens included) and the tokens it sampled"),
)


class SchedulerFamilies:
    """Registered once; `update` hands it the live schedulers' (replica, stats) before each scrape."""

    def __init__(self, model_name: str, replicas: int) -> None:
        self.model_name = model_name
        self.replicas = replicas
        self.stats: list[tuple[int, SchedulerStats]] = []

    def update(self, scheduler_stats: list[tuple[int, SchedulerStats]]) -> None:
        self.stats = scheduler_stats

    def collect(self) -> Iterator[Metric]:
        gauges = {name: GaugeMetricFamily(PREFIX + name, doc, labels=LABELS) for name, doc in (
            ("num_requests_running", "Requests running on the device"),
            ("num_requests_waiting", "Requests waiting to run"),
            ("kv_cache_usage_perc", "Fraction of KV cache pages in use (0..1)"),
            ("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens (0..1)"),
            ("spec_decode_acceptance_rate", "Speculative decoding: draft tokens accepted / draft tokens verified (0..1)"))}
        by_reason = GaugeMetricFamily(PREFIX + "num_requests_waiting_by_reason",
                                      "Requests waiting, by reason: capacity (a slot, token budget or KV pages) or "
                                      "deferred (admission held: paused, new weights or memory awaited)",
                                      labels=(*LABELS, "reason"))
        info = GaugeMetricFamily(PREFIX + "cache_config_info", "The KV cache's configuration (vLLM's CacheConfig)",
                                 labels=(*LABELS, "block_size", "num_gpu_blocks", "enable_prefix_caching"))
        slots = GaugeMetricFamily(PREFIX + "state_slots_usage_perc",
                                  "Fraction of the recurrent-state slots in use (0..1): a hybrid's linear layers' states, "
                                  "one slot per running request", labels=LABELS)
        counters = [(CounterMetricFamily(PREFIX + name, doc, labels=LABELS), key) for name, key, doc in COUNTERS]
        histograms = [(HistogramMetricFamily(PREFIX + name, doc, labels=LABELS), name, bounds) for name, bounds, doc in HISTOGRAMS]
        for replica in range(self.replicas):
            stats = [s for r, s in self.stats if r == replica]  # none while it is down
            labels = [self.model_name, str(replica)]
            gauges["num_requests_running"].add_metric(labels, _total(stats, "running"))
            gauges["num_requests_waiting"].add_metric(labels, _total(stats, "waiting"))
            gauges["kv_cache_usage_perc"].add_metric(labels, kv_usage(stats))
            gauges["prefix_cache_hit_rate"].add_metric(labels, prefix_hit_rate(stats))
            gauges["spec_decode_acceptance_rate"].add_metric(labels, acceptance_rate(stats))
            deferred = _total(stats, "waiting_deferred")
            by_reason.add_metric([*labels, "capacity"], _total(stats, "waiting") - deferred)
            by_reason.add_metric([*labels, "deferred"], deferred)
            if len(stats) != 1:
                continue  # down (or, for a moment, two instances of one replica: no series rather than a sum of two)
            s = stats[0]
            if s.state_slots_total:  # a hybrid's state pool, beside its pages
                slots.add_metric(labels, s.state_slots_used / s.state_slots_total)
            info.add_metric([*labels, str(s.page_size), str(s.pages_total), str(s.prefix_cache == 1)], 1)
            for family, key in counters:
                family.add_metric(labels, _total(stats, key))
            for family, name, bounds in histograms:
                read = histogram.read(s, name, bounds)
                if read is not None:
                    counts, total = read
                    family.add_metric(labels, [(_le(b), c) for b, c in zip((*bounds, float("inf")), counts)], total)
        yield from gauges.values()
        yield from (by_reason, info, slots)
        yield from (family for family, _ in counters)
        yield from (family for family, _, _ in histograms)


def kv_usage(stats: list[SchedulerStats]) -> float:
    """Pages in use / all pages (0..1): cached pages nobody reads count as free, as they are
    evicted on demand (SGLang's token_usage; vLLM's kv_cache_usage_perc likewise)."""
    pages = _total(stats, "pages_total")
    return (_total(stats, "pages_used") - _total(stats, "pages_evictable")) / pages if pages else 0.0


def prefix_hit_rate(stats: list[SchedulerStats]) -> float:
    """Prompt tokens read from the prefix cache / prompt tokens, since the scheduler started (0..1)."""
    queries = _total(stats, "prefix_cache_queries_total")
    return _total(stats, "prefix_cache_hits_total") / queries if queries else 0.0


def acceptance_rate(stats: list[SchedulerStats]) -> float:
    """Draft tokens accepted / draft tokens verified, since the scheduler started (0..1; 0 before any)."""
    drafted = _total(stats, "spec_decode_num_draft_tokens_total")
    return _total(stats, "spec_decode_num_accepted_tokens_total") / drafted if drafted else 0.0


def _total(stats: list[SchedulerStats], field: str) -> int:
    return sum(getattr(s, field) for s in stats)


def _le(bound: float) -> str:
    """A bucket's `le` label as prometheus_client writes its own ("0.3", "1.0", "+Inf")."""
    return "+Inf" if bound == float("inf") else repr(float(bound))
