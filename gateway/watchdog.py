"""Failing requests whose state died with a service, instead of letting clients wait forever.

A scheduler or a worker holds the state of every request in its replica (queues and pages, the
KV cache). When an instance of either stops beating, the requests in flight through this gateway
cannot complete: every one of them gets a 503 (an SSE error event when streaming), and its abort
frees what the survivors still hold. A detokenizer holds only its own requests' text, so the
scheduler fails just those (it knows which); a tokenizer holds nothing (another one claims its
entries).

It also keeps which roles have no live instance at all, so that new requests get a 503 at once
rather than wait in a stream nobody reads.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.replies import ReplyRouter
from jaxstream.transport import TRANSIENT, Bus, role_of

log = logging.getLogger(__name__)

STATEFUL = ("scheduler", "worker")
PIPELINE = ("tokenizer", "scheduler", "worker", "detokenizer")


class Watchdog:
    def __init__(self, bus: Bus, router: ReplyRouter) -> None:
        self.bus = bus
        self.router = router
        self.known: set[str] = set()
        self.missing: list[str] = []  # pipeline roles with no live instance, as of the last check
        self.generation = bus.generation

    async def still_missing(self) -> list[str]:
        """Look again (the last check may predate a service's start)."""
        self.missing = missing_roles(await self.bus.live_names())
        return self.missing

    async def check(self) -> None:
        names = await self.bus.live_names()
        self.missing = missing_roles(names)
        live = {name for name in names if role_of(name) in STATEFUL}
        gone = sorted(self.known - live)
        if gone:
            await self.bus.beat()  # all heartbeats vanish in a Redis restart: see if that is what this is
        restarted = self.bus.generation != self.generation  # then the restart listener failed them
        self.generation = self.bus.generation
        if gone and not restarted:
            log.error("%s stopped: failing %d requests in flight", ", ".join(gone), len(self.router.queues))
            self.router.fail_all(f"{', '.join(role_of(g) for g in gone)} stopped")
        self.known = live

    async def run(self) -> None:
        while not self.bus.closing:
            try:
                await self.check()
            except TRANSIENT as exc:
                log.warning("watchdog: Redis unreachable (%s)", exc)
            await asyncio.sleep(self.bus.cfg.heartbeat_ms / 1000)


def missing_roles(live_names: list[str], roles: tuple[str, ...] = PIPELINE) -> list[str]:
    live = {role_of(name) for name in live_names}
    return [role for role in roles if role not in live]
