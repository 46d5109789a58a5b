"""Whether this process reaches Redis, said once as it stops, again while it lasts, once as it ends."""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

REMIND_S = 30.0  # while Redis stays unreachable, one line this often


class Outage:
    """One warning when Redis stops answering, one every REMIND_S while it stays down, one line when
    it is back: not a line per retry of every loop (a whole stack's loops retry every half second)."""

    def __init__(self) -> None:
        self.since: float | None = None  # when it first failed, while it fails
        self.reminded = 0.0

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        if self.since is None:
            self.since = self.reminded = now
            log.warning("Redis unreachable (%s); retrying", exc)
        elif now - self.reminded >= REMIND_S:
            self.reminded = now
            log.warning("Redis still unreachable after %.0f s (%s); retrying", now - self.since, exc)

    def ok(self) -> None:
        if self.since is not None:
            log.warning("Redis reachable again after %.1f s", time.monotonic() - self.since)
            self.since = None

    def down_for(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since
