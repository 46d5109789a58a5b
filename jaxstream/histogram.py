"""A Prometheus histogram kept where its values arise and read where /metrics is served.

The scheduler times its requests and counts its steps' tokens, but the gateway serves /metrics:
the scheduler keeps each histogram as cumulative bucket counts and a sum, and publishes them in its
stats (protocol.SchedulerStats, two fields per histogram: `<name>_buckets`, the cumulative counts,
one per bound and a last one for +Inf, which is the count; `<name>_sum`). The gateway reads them
back with `read` and renders them per replica. Like any Prometheus counter they start at 0 when
the process does.

Bucket bounds are vLLM's (vllm/v1/metrics/loggers.py), so dashboards built for it read ours.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# vLLM's request_latency_buckets: e2e, queue, prefill, decode and inference times (seconds).
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's build_1_2_5_buckets, for token counts)."""
    bounds, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(bounds)
            bounds.append(m * scale)
        scale *= 10


@dataclass
class Histogram:
    bounds: tuple[float, ...]  # upper bounds, ascending; +Inf is implied
    counts: list[int] = field(default_factory=list)  # per bucket (not cumulative), len(bounds) + 1
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # a value equal to a bound is in its bucket (le)
        self.sum += value

    def stats(self, name: str) -> dict[str, tuple[int, ...] | float]:
        """Its two fields of the stats, by name."""
        cumulative, total = [], 0
        for c in self.counts:
            total += c
            cumulative.append(total)
        return {f"{name}_buckets": tuple(cumulative), f"{name}_sum": float(self.sum)}


def read(stats: object, name: str, bounds: tuple[float, ...]) -> tuple[list[int], float] | None:
    """(cumulative counts, one per bound and +Inf; sum) of histogram `name` in a scheduler's stats;
    None when it was kept with other bounds (a scheduler built with others: no series rather than
    wrong ones)."""
    counts = getattr(stats, f"{name}_buckets")
    if len(counts) != len(bounds) + 1:
        return None
    return list(counts), getattr(stats, f"{name}_sum")
