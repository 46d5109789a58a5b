"""Failing requests whose state died with a service, instead of letting clients wait forever.

A scheduler or a worker holds the state of every request in its replica (queues and pages, the
KV cache). When an instance of either stops beating, the requests in flight through this gateway
cannot complete: every one of them gets a 503 (an SSE error event when streaming), and its abort
frees what the survivors still hold. A detokenizer holds only its own requests' text, so the
scheduler fails just those (it knows which); a tokenizer holds nothing (another one claims its
entries).
"""

from __future__ import annotations

import asyncio
import logging

from gateway.replies import ReplyRouter
from jaxstream.transport import TRANSIENT, Bus, role_of

log = logging.getLogger(__name__)

STATEFUL = ("scheduler", "worker")


class Watchdog:
    def __init__(self, bus: Bus, router: ReplyRouter) -> None:
        self.bus = bus
        self.router = router
        self.known: set[str] = set()

    async def check(self) -> None:
        live = {name for name in await self.bus.live_names() if role_of(name) in STATEFUL}
        gone = sorted(self.known - live)
        if gone:
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
