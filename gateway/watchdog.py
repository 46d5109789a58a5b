"""Failing requests whose state died with a service, instead of letting clients wait forever.

A scheduler or a worker holds the state of every request in its replica (queues and pages, the
KV cache). When an instance of either stops beating, the requests in flight through this gateway
on that replica cannot complete: every one of them gets a 503 (an SSE error event when
streaming), and its abort frees what the survivors still hold. Other replicas' requests go on. A
detokenizer holds only its own requests' text, so the scheduler fails just those (it knows which);
a tokenizer holds nothing (another one claims its entries).

Redis itself unreachable for a heartbeat TTL fails every request in flight through this gateway:
none can get its output, and a Redis that comes back empty would leave them waiting for good.

It also keeps which roles have no live instance at all (a scheduler or worker counted per replica),
and which replicas are whole, so that new requests go only to those, or get a 503 at once when
none can serve them rather than wait in a stream nobody reads. That 503 says whether the missing
role is starting (and how far it got: "the worker is starting: compiling step shapes 40/66") or
not running at all.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.replicas import Replicas
from gateway.replies import ReplyRouter
from jaxstream.names import REPLICATED, replica_of, role_of
from jaxstream.transport import TRANSIENT, Bus

log = logging.getLogger(__name__)

PIPELINE = ("tokenizer", "scheduler", "worker", "detokenizer")


class Watchdog:
    def __init__(self, bus: Bus, router: ReplyRouter, replicas: Replicas) -> None:
        self.bus = bus
        self.router = router
        self.replicas = replicas
        self.known: set[str] = set()
        self.missing: list[str] = []  # pipeline roles with no live instance, as of the last check
        self.up: list[int] = list(range(replicas.count))  # replicas whose scheduler and worker live
        self.generation = bus.generation
        self._checking = asyncio.Lock()  # one check at a time: each reads the names, then acts on them

    def unavailable(self) -> list[str]:
        """The missing roles that stop every new request: a tokenizer or a detokenizer, or the
        scheduler or worker of every replica."""
        return self.missing if not self.up else [m for m in self.missing if role_of(m) not in REPLICATED]

    async def look(self) -> None:
        """Look again (the last check may predate a service's start): a whole check, so an instance
        that stopped since the last one fails its requests now, not after the request that asked
        to look was admitted to its restarted replica (which the next check would fail with them)."""
        await self.check()

    def _update(self, names: list[str]) -> None:
        self.missing = missing_roles(names, self.replicas.count)
        self.up = up_replicas(self.missing, self.replicas.count)

    async def check(self) -> None:
        async with self._checking:
            await self._check()

    async def _check(self) -> None:
        names = await self.bus.live_names()
        self._update(names)
        live = {name for name in names if role_of(name) in REPLICATED}
        gone = sorted(self.known - live)
        if gone:
            await self.bus.beat()  # all heartbeats vanish in a Redis restart: see if that is what this is
        restarted = self.bus.generation != self.generation  # then the restart listener failed them
        self.generation = self.bus.generation
        if gone and not restarted:
            rids = self.replicas.rids_on({replica_of(g) for g in gone})
            what = ", ".join(label(g, self.replicas.count) for g in gone)
            if rids:
                log.error("%s stopped: failing %d requests in flight", what, len(rids))
                self.router.fail(rids, f"{what} stopped")
            else:  # nothing failed: a restart's partner, or an idle replica
                log.warning("%s stopped; no request in flight through this gateway", what)
        self.known = live

    async def run(self) -> None:
        while not self.bus.closing:
            try:
                await self.check()
            except TRANSIENT as exc:
                self.bus.outage.failed(exc)
                self.outlived_redis()
            await asyncio.sleep(self.bus.cfg.heartbeat_ms / 1000)

    def outlived_redis(self) -> None:
        """Redis unreachable for a heartbeat TTL: no output can reach a request in flight, nor will
        any if Redis restarted empty. End them (an SSE error event and [DONE], or a 503) rather than
        leave their clients waiting; a shorter blip lets them go on."""
        if self.bus.outage.down_for() * 1000 >= self.bus.cfg.heartbeat_ttl_ms and self.router.queues:
            log.error("Redis unreachable for %.0f s: failing %d requests in flight", self.bus.outage.down_for(),
                      len(self.router.queues))
            self.router.fail_all("the server's Redis is unreachable")


def replica_label(role: str, replica: int, replicas: int) -> str:
    """How health names a replicated role's instance: `worker.1` when there are several replicas,
    else `worker`."""
    return f"{role}.{replica}" if replicas > 1 else role


def label(name: str, replicas: int) -> str:
    replica = replica_of(name)
    return role_of(name) if replica is None else replica_label(role_of(name), replica, replicas)


def expected(roles: tuple[str, ...], replicas: int) -> list[str]:
    """The labels of every instance the pipeline needs: a scheduler and a worker per replica."""
    out = []
    for role in roles:
        if role in REPLICATED:
            out += [replica_label(role, r, replicas) for r in range(replicas)]
        else:
            out.append(role)
    return out


def missing_roles(live_names: list[str], replicas: int = 1, roles: tuple[str, ...] = PIPELINE) -> list[str]:
    live = {label(name, replicas) for name in live_names}
    return [want for want in expected(roles, replicas) if want not in live]


def up_replicas(missing: list[str], replicas: int) -> list[int]:
    """The replicas whose scheduler and worker are both live."""
    return [r for r in range(replicas) if not any(replica_label(role, r, replicas) in missing for role in REPLICATED)]


def starting_labels(starting: dict[str, str], replicas: int) -> dict[str, str]:
    """Bus.starting's phases by instance name, by health's labels (`worker`, `worker.1`)."""
    return {label(name, replicas): phase for name, phase in starting.items()}


def only_starting(missing: list[str], starting: dict[str, str]) -> bool:
    """Every missing role (by label) is starting, none is simply not running."""
    return all(m in starting for m in missing)


def unavailable_message(missing: list[str], starting: dict[str, str]) -> str:
    """The 503's message for `missing` roles, given the phases of the ones starting (by label):
    while every missing one is starting, what each is doing; else which are not running."""
    if only_starting(missing, starting):
        return "; ".join(f"the {m} is starting" + (f": {starting[m]}" if starting[m] else "") for m in missing)
    return f"service unavailable: no {', '.join(m for m in missing if m not in starting)} running"
