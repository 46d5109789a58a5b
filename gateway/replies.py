"""Routing this gateway's reply stream to per-request queues."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from jaxstream import protocol
from jaxstream.transport import Bus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lost:
    """Put in a request's queue by the gateway itself: the pipeline lost the request's state."""

    message: str


class ReplyRouter:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.stream = bus.keys.gateway(bus.name)
        self.queues: dict[str, asyncio.Queue] = {}
        bus.on_restart(lambda: self.fail_all("the server's Redis restarted"))

    def open(self, rid: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = queue
        return queue

    def close(self, rid: str) -> None:
        self.queues.pop(rid, None)

    def fail_all(self, why: str) -> None:
        self.fail(list(self.queues), why)

    def fail(self, rids: list[str], why: str) -> None:
        for rid in rids:
            self.deliver(rid, Lost(f"{why}; the request was lost, retry it"))

    async def run(self, inbox) -> None:
        async for batch in inbox.batches():
            for _, message in batch:
                match message:
                    case protocol.OutputBatch(outputs=outputs):
                        for output in outputs:
                            self.deliver(output.rid, output)
                    case (protocol.RequestRejected(rid=rid) | protocol.TokenizeReply(rid=rid) | protocol.FlushCacheReply(rid=rid)
                          | protocol.ControlReply(rid=rid)):
                        self.deliver(rid, message)

    def deliver(self, rid: str, item: object) -> None:
        queue = self.queues.get(rid)
        if queue is not None:  # else its client is gone; the abort is on its way
            queue.put_nowait(item)
