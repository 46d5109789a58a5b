"""When `jaxstream up` restarts a service that died, and when it gives up. Pure policy: the
launcher (launcher.py) holds the processes and asks here.

- A unit restarts as a whole: a gateway, a tokenizer or a detokenizer alone (they hold nothing
  another instance cannot take over); a replica's scheduler and worker together (each holds half of
  the replica's requests: queues and pages on one side, the KV cache on the other, and neither is
  any use without the other's); the embedded Redis alone (the services reconnect through the epoch).
- Back-off: the n-th death within the window waits BACKOFF_S * 2^(n-1) (0.5, 1, 2, 4, 8 s) before
  the restart, so a service that cannot start does not spin.
- Crash loop: more than `max_restarts` deaths of one unit within `window_s` stop the stack, with
  a message naming the unit.
"""

from __future__ import annotations

from collections import deque

from jaxstream.names import REPLICATED

BACKOFF_S = 0.5
REDIS = "redis"  # the embedded redis-server's unit


def unit_of(name: str) -> str:
    """The unit a child belongs to: `replica 1` for `scheduler.1` and `worker.1` (`replica 0` for an
    unreplicated `scheduler`), else the child's own name."""
    role, _, replica = name.partition(".")
    return f"replica {replica or 0}" if role in REPLICATED else name


class CrashLoop(Exception):
    """A unit died more than max_restarts times within the window."""


class Restarts:
    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.deaths: dict[str, deque[float]] = {}  # unit -> when it died, within the window

    def died(self, unit: str, now: float) -> float:
        """Record a death of `unit`; how long to wait before starting it again. CrashLoop when it
        died more than max_restarts times within the window."""
        deaths = self.deaths.setdefault(unit, deque())
        deaths.append(now)
        while deaths and deaths[0] <= now - self.window_s:
            deaths.popleft()
        if len(deaths) > self.max_restarts:
            raise CrashLoop(f"{unit} died {len(deaths)} times within {self.window_s:g} s")
        return BACKOFF_S * 2 ** (len(deaths) - 1)
