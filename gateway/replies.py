"""Routing this gateway's reply stream to per-request queues.

A request's outputs are numbered by its detokenizer (RequestOutput.seq, from 1) and delivered in
that order: one that comes twice is dropped, and one that skips a number fails the request with a
clean error (Lost: a 503, or an SSE error event once streaming) rather than hand its client text
with a hole in it. Its later outputs are dropped. An output numbered 0 is the end of a request its
detokenizer no longer held, taken as it comes.
"""

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
        self.next_seq: dict[str, int] = {}  # per open request: the number its next output must carry; 0 once failed
        bus.on_restart(lambda: self.fail_all("the server's Redis restarted"))

    def open(self, rid: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = queue
        self.next_seq[rid] = 1
        return queue

    def close(self, rid: str) -> None:
        self.queues.pop(rid, None)
        self.next_seq.pop(rid, None)

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
                            self.output(output)
                    case (protocol.RequestRejected(rid=rid) | protocol.TokenizeReply(rid=rid) | protocol.FlushCacheReply(rid=rid)
                          | protocol.ControlReply(rid=rid)):
                        self.deliver(rid, message)

    def output(self, output: protocol.RequestOutput) -> None:
        """One of a request's outputs, in order (this module's docstring)."""
        expected = self.next_seq.get(output.rid)
        if expected is None or output.seq == 0:  # not ours (its client left), or unnumbered
            self.deliver(output.rid, output)
        elif output.seq == expected:
            self.next_seq[output.rid] = expected + 1
            self.deliver(output.rid, output)
        elif expected and output.seq > expected:
            log.error("request %s: output %d came when %d was due: failing it", output.rid, output.seq, expected)
            self.next_seq[output.rid] = 0
            self.deliver(output.rid, Lost(f"output {expected} of the request never reached the gateway; "
                                          "the request was lost, retry it"))
        elif expected:  # delivered before
            log.warning("request %s: output %d came again: dropped", output.rid, output.seq)

    def deliver(self, rid: str, item: object) -> None:
        queue = self.queues.get(rid)
        if queue is not None:  # else its client is gone; the abort is on its way
            queue.put_nowait(item)
