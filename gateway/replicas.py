"""Which data-parallel replica (a scheduler+worker pair, `parallelism.data` of them) runs each request.

By load: a new request goes to the replica where this gateway has the fewest requests in flight;
among equally loaded ones the choice rotates, so an idle stack spreads its requests (and `n`
samples or a batch's prompts, each its own request, land on different replicas). Only replicas
whose scheduler and worker are both alive are chosen (the watchdog says which).

Each gateway counts only its own requests: no round trip per request, and with one gateway (the
usual set-up) the count is exact. Each replica's scheduler has a prefix cache of its own, but routing
does not look at prefixes yet (prefix affinity: send a prompt where its prefix is cached).

Pure: no Redis, no clock.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable


class Replicas:
    def __init__(self, count: int) -> None:
        self.count = count
        self.in_flight = [0] * count  # this gateway's requests on each replica
        self._held: dict[str, int] = {}  # rid -> its replica
        self._next = 0  # where the rotation among equally loaded replicas resumes

    def choose(self, up: Collection[int]) -> int:
        """The least loaded of the replicas in `up` (not empty); ties go to the first at or after
        the rotation point."""
        least = min(self.in_flight[r] for r in up)
        tied = [r for r in up if self.in_flight[r] == least]
        replica = min(tied, key=lambda r: (r - self._next) % self.count)
        self._next = (replica + 1) % self.count
        return replica

    def assign(self, rid: str, up: Collection[int]) -> int:
        """Choose a replica for a new request and count it there until `release`."""
        replica = self.choose(up)
        self._held[rid] = replica
        self.in_flight[replica] += 1
        return replica

    def release(self, rid: str) -> None:
        replica = self._held.pop(rid, None)
        if replica is not None:
            self.in_flight[replica] -= 1

    def replica_of(self, rid: str) -> int | None:
        """The replica of a request in flight through this gateway; None for any other rid."""
        return self._held.get(rid)

    def rids_on(self, replicas: Iterable[int]) -> list[str]:
        """This gateway's requests in flight on these replicas."""
        wanted = set(replicas)
        return [rid for rid, replica in self._held.items() if replica in wanted]
