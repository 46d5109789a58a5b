"""The worker's idle gap: how long the device waits between one decode step and the next.

A gap is measured from the end of a step to the start of the next when the next continues some of
its requests (they share a rid): the time a running batch waits on the worker's own loop, Redis and
the scheduler. With overlap (scheduler.overlap) the next step is already read when a step ends, so
the gap is the loop's own overhead; without it, the gap holds a round trip through the scheduler.
A gap before a step of new requests only is the load's, not the pipeline's: not counted.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from jaxstream.protocol import Step

WINDOW = 4096  # the most recent gaps the figures cover


class IdleGaps:
    def __init__(self) -> None:
        self.gaps_ms: deque[float] = deque(maxlen=WINDOW)
        self.total = 0  # gaps measured since start-up
        self._ended_at: float | None = None
        self._rids: frozenset[str] = frozenset()  # of the last step

    def starting(self, step: Step) -> None:
        now = time.perf_counter()
        rids = frozenset(seq.rid for seq in step.seqs)
        if self._ended_at is not None and rids & self._rids:
            self.gaps_ms.append((now - self._ended_at) * 1000)
            self.total += 1
        self._rids = rids

    def ended(self) -> None:
        self._ended_at = time.perf_counter()

    def stats(self) -> dict[str, float | int]:
        """Median, p90 and p99 of the window, in ms, and how many gaps were measured in all."""
        if not self.gaps_ms:
            return {"idle_gaps": 0}
        p50, p90, p99 = np.percentile(np.fromiter(self.gaps_ms, float, len(self.gaps_ms)), [50, 90, 99])
        return {"idle_gaps": self.total, "idle_gap_ms_p50": round(float(p50), 3), "idle_gap_ms_p90": round(float(p90), 3),
                "idle_gap_ms_p99": round(float(p99), 3)}
