"""Where new requests wait while generation is paused or weights are swapped, on every gateway.

The reasons live in Redis (`Bus.holds`: reason -> deadline), so a pause asked of one gateway holds
the requests of all; each request looks before it enters the pipeline (one round trip), and a held
one looks again every HOLD_POLL_S. Held here, not in the scheduler, they are in no queue a flush or
an update must wait for. While device memory is released a request is refused at once, with a 503
saying so: it could wait for a trainer that resumes minutes later, or never. While a release is
only asked for, requests wait: the replicas may refuse it (a request running), and then nothing
was released.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from gateway.errors import ApiError
from jaxstream.transport import Bus

HOLD_POLL_S = 0.02
# A hold its gateway renews (`holding`) lasts this long unrenewed: a gateway that dies mid-update
# holds new requests no longer than that.
HOLD_LEASE_S = 15.0
PAUSED = "paused"  # /pause_generation, until /continue_generation
UPDATE = "update:"  # + the update's rid: its commit, until the weights are swapped (or its deadline)
RELEASING = "releasing:"  # + the release's rid: until the replicas answered it
RELEASED = "released:"  # + a memory tag, until /resume_memory_occupation resumes it


class Gate:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.held = 0  # requests waiting here now

    async def enter(self) -> None:
        """Returns once a new request may enter the pipeline; a 503 while memory is released."""
        holds = await self.bus.holds()
        if not holds:
            return
        self.held += 1
        try:
            while holds:
                if released := sorted(r.removeprefix(RELEASED) for r in holds if r.startswith(RELEASED)):
                    raise ApiError(503, f"the server has released its {' and '.join(released)} memory "
                                        "(/release_memory_occupation): /resume_memory_occupation first")
                await asyncio.sleep(HOLD_POLL_S)
                holds = await self.bus.holds()
        finally:
            self.held -= 1

    @contextlib.asynccontextmanager
    async def holding(self, reason: str) -> AsyncIterator[None]:
        """New requests wait at every gateway while the block runs, on a lease renewed meanwhile."""

        async def renew() -> None:
            while True:
                await self.bus.set_hold(reason, HOLD_LEASE_S)
                await asyncio.sleep(HOLD_LEASE_S / 3)

        await self.bus.set_hold(reason, HOLD_LEASE_S)
        lease = asyncio.create_task(renew())
        try:
            yield
        finally:
            lease.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lease
            await self.bus.clear_hold(reason)
