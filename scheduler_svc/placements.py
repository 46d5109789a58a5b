"""Which detokenizer carries each request, kept for a while after the request ends here.

A request ends at the scheduler when its last token is sampled, but its client has it only once its
detokenizer sent the last output. A detokenizer that dies in between takes that output with it, and
its death is seen up to a heartbeat TTL later (at once under `jaxstream up`, which deletes the dead
child's heartbeat). So a dead detokenizer's requests are failed (a RequestRejected to their gateway)
whether they still run or ended within `keep_s`: a gateway whose client already had the whole
answer closed that request and drops the rejection.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Placement:
    gateway: str
    detokenizer: str
    ended_at: float | None = None  # when the scheduler was first seen without it


class Placements:
    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self.by_rid: dict[str, Placement] = {}

    def place(self, rid: str, gateway: str, detokenizer: str) -> None:
        self.by_rid[rid] = Placement(gateway, detokenizer)

    def refresh(self, held: set[str], now: float) -> None:
        """`held`: the requests the scheduler still has. Mark the others ended; forget those that
        ended more than keep_s ago."""
        for rid, p in list(self.by_rid.items()):
            if rid in held:
                continue
            if p.ended_at is None:
                p.ended_at = now
            elif now - p.ended_at > self.keep_s:
                del self.by_rid[rid]

    def lost(self, live: set[str]) -> list[tuple[str, Placement]]:
        """Take out the (rid, placement) of every request on a detokenizer not in `live`."""
        gone = [(rid, p) for rid, p in self.by_rid.items() if p.detokenizer not in live]
        for rid, _ in gone:
            del self.by_rid[rid]
        return gone
