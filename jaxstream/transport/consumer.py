"""Reading streams in a consumer group: blocking reads, acks after the handler, and the group's
housekeeping (what dead members held, what idled too long, dead instances' groups, trimming).

1. A consumer is in the group of its role (the instances share the work) or of its instance (it
   sees every entry; the group dies with the instance). Groups are created idempotently (MKSTREAM,
   BUSYGROUP ignored) and read with blocking XREADGROUP. `batches()` yields decoded messages and
   acks them only when the caller asks for the next batch, i.e. after its handler succeeded; the
   ack rides in one pipeline with the next read.
2. No read is lost. Redis moves what a read hands over into the consumer's pending list before the
   reply travels; a reply that never arrives (the connection failed after Redis delivered) would
   leave those entries waiting for the idle backstop below, out of order. So after any error, and
   at its first read, a consumer first reads its own pending entries again (XREADGROUP ... 0,
   `count` at a time, acking as it goes, until it gets none), oldest first, and only then new ones
   (`>`): an entry it was handed comes back at once, and in stream order, since everything new is
   newer. Such a re-read counts as a delivery (XPENDING's times_delivered). A healthy read cannot
   time out: the connection has no socket timeout (client.py says why and what finds a dead one),
   and Redis answers a BLOCK read within redis.block_ms; a process that stalls reads its reply
   when it resumes.
3. About once a heartbeat, inside the read loop: entries pending on a consumer whose heartbeat
   expired are claimed (XPENDING + XCLAIM) and handled here; a backstop XAUTOCLAIM takes anything
   idle far longer than any handler runs; an entry delivered more than `max_deliveries` times goes
   to the dead-letter stream; the group of a dead instance is dropped; acknowledged entries are
   trimmed (XTRIM MINID below the oldest entry any group still needs), MAXLEN ~ on XADD being the
   hard memory cap.
4. After a Redis restart (the bus's `generation` moved) the groups are recreated from id 0: the
   streams are new, so 0 is everything written since. A lost group or stream (NOGROUP, "no such
   key") checks the epoch first: without a restart the group was dropped by a peer, and comes back
   reading from now on.
5. While Redis is unreachable, reads wait and retry; nothing raises into a service loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec

from jaxstream.transport.client import TRANSIENT, Refused, client

if TYPE_CHECKING:
    from jaxstream.transport.bus import Bus

log = logging.getLogger(__name__)

FIELD = b"m"  # every stream entry has one field holding one msgpack message


class Consumer:
    """A member of one consumer group, reading one or more streams."""

    def __init__(self, bus: Bus, streams: list[str], decoder: msgspec.msgpack.Decoder, count: int, group: str,
                 reclaim: bool = True) -> None:
        self.bus, self.streams, self.group = bus, streams, group
        self.decoder, self.count, self.reclaim = decoder, count, reclaim
        self._redis = client(bus.cfg, max_connections=1, waits=True, name=bus.name)  # a blocked read holds its connection
        self._generation = -1
        self._pending_first = True  # read our own pending entries before new ones (2.): at the first read, after an error
        self._next_housekeeping = 0.0
        self.reclaimed = 0  # entries taken over from dead or stuck consumers

    async def ensure_groups(self, from_start: bool) -> None:
        """Create the group on each stream. A stream that already exists (another stack run, an
        earlier process of ours) is read from now on ($); after a Redis restart, from 0."""
        for stream in self.streams:
            try:
                await self._redis.xgroup_create(stream, self.group, id="0" if from_start else "$", mkstream=True)
            except Refused as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
            # Exist as a consumer from now on (Redis 6.2 creates one only when it delivers), so a
            # group of an instance that died before reading anything is seen idle, then dropped.
            await self._redis.xgroup_createconsumer(stream, self.group, self.bus.name)
        self._generation = self.bus.generation

    async def batches(self, idle: bool = False) -> AsyncIterator[list[tuple[str, Any]]]:
        """Yield lists of (stream, message). Entries are acked once the caller comes back for
        the next batch; a handler that raises leaves them pending, to be redelivered. `idle`: also
        yield an empty list when a read found nothing (a blocking read gives up after redis.block_ms),
        for a loop whose timed work must run while no message comes."""
        to_ack: list[tuple[str, bytes]] = []
        while not self.bus.closing:
            try:
                if self._generation != self.bus.generation:
                    await self.ensure_groups(from_start=self._generation >= 0)
                entries = await self._housekeeping(to_ack) if time.monotonic() >= self._next_housekeeping else []
                if not entries:
                    entries = await self._read(to_ack)
                to_ack = []
                self.bus.outage.ok()
            except Refused as exc:
                # NOGROUP from reads, "no such key" from XINFO: our stream or group is gone
                if "NOGROUP" not in str(exc) and "no such key" not in str(exc):
                    raise
                await self._recreate_lost_group()
                continue
            except TRANSIENT as exc:
                # Redis may have delivered what this round asked for (a read, a claim) before the
                # reply was lost: it is in our pending list, read first next time (2.).
                self._pending_first = True
                self.bus.outage.failed(exc)
                await asyncio.sleep(0.5)
                continue
            messages = self._decode(entries)
            if messages or (idle and not entries):
                yield messages
            to_ack = [(stream, entry_id) for stream, entry_id, _ in entries]
        if to_ack:
            await self._ack(to_ack)

    async def close(self) -> None:
        await self._redis.aclose()

    # -- internals ----------------------------------------------------------------------------

    async def _recreate_lost_group(self) -> None:
        """After a Redis restart the streams are new: read them from 0. Otherwise someone dropped
        our group (took us for dead): from now on, not the stream's whole past."""
        try:
            await self.bus.beat()
            restarted = self._generation != self.bus.generation
            log.warning("group %s lost on %s (%s): recreating", self.group, self.streams,
                        "Redis restarted" if restarted else "dropped")
            await self.ensure_groups(from_start=restarted)
        except TRANSIENT as exc:  # gone again: the next round retries
            self.bus.outage.failed(exc)
            await asyncio.sleep(0.5)

    # -- reading ----------------------------------------------------------------------------

    async def _read(self, to_ack: list[tuple[str, bytes]]) -> list[tuple[str, bytes, bytes]]:
        """Our own pending entries while some may be there (2.), else new ones, blocking. The acks
        go first in the same round trip, so a re-read never returns what was handled."""
        while self._pending_first:
            entries, returned = await self._read_from(to_ack, "0", block=None)
            if entries:
                return entries
            to_ack = []  # acked with that read
            self._pending_first = returned > 0  # only trimmed ones: there may be more behind them
        return (await self._read_from(to_ack, ">", block=self.bus.cfg.block_ms))[0]

    async def _read_from(self, to_ack: list[tuple[str, bytes]], start: str,
                         block: int | None) -> tuple[list[tuple[str, bytes, bytes]], int]:
        """(the entries read from `start` on, how many Redis returned: trimmed ones too, acked here)."""
        pipe = self._redis.pipeline(transaction=False)
        self._queue_acks(pipe, to_ack)
        pipe.xreadgroup(self.group, self.bus.name, {s: start for s in self.streams}, count=self.count, block=block)
        replies = await pipe.execute()
        entries, gone = [], []
        for stream, items in replies[-1] or []:
            stream = stream.decode()
            for entry_id, fields in items:
                if fields:
                    entries.append((stream, entry_id, fields.get(FIELD, b"")))
                else:  # pending, but trimmed from the stream since: nothing left to handle
                    gone.append((stream, entry_id))
        if gone:
            log.warning("%d pending entries of %s were trimmed before they were handled", len(gone), self.bus.name)
            await self._ack(gone)
        return entries, len(entries) + len(gone)

    async def _ack(self, to_ack: list[tuple[str, bytes]]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        self._queue_acks(pipe, to_ack)
        await pipe.execute()

    def _queue_acks(self, pipe: Any, to_ack: list[tuple[str, bytes]]) -> None:
        by_stream: dict[str, list[bytes]] = {}
        for stream, entry_id in to_ack:
            by_stream.setdefault(stream, []).append(entry_id)
        for stream, ids in by_stream.items():
            pipe.xack(stream, self.group, *ids)

    def _decode(self, entries: list[tuple[str, bytes, bytes]]) -> list[tuple[str, Any]]:
        out = []
        for stream, entry_id, payload in entries:
            try:
                out.append((stream, self.decoder.decode(payload)))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                # Acked with the batch, never retried: a message that cannot decode never will.
                log.error("undecodable entry %s on %s dropped: %s", entry_id, stream, exc)
        return out

    async def _housekeeping(self, to_ack: list[tuple[str, bytes]]) -> list[tuple[str, bytes, bytes]]:
        """Once a heartbeat: claim what dead consumers held, sweep what idled far too long, trim acked entries."""
        self._next_housekeeping = time.monotonic() + self.bus.cfg.heartbeat_ms / 1000
        await self._ack_now(to_ack)
        claimed: list[tuple[str, bytes, bytes]] = []
        for stream in self.streams:
            claimed += await self._settle_dead_consumers(stream)
            claimed += await self._sweep_idle(stream)
            groups = await self._drop_dead_groups(stream, await self._redis.xinfo_groups(stream))
            await self._trim(stream, groups)
        self.reclaimed += len(claimed)
        return claimed

    async def _ack_now(self, to_ack: list[tuple[str, bytes]]) -> None:
        """Ack the last batch here, not with the next read: this round may return claimed entries
        instead of reading, and the trim should see the batch done."""
        if to_ack:
            await self._ack(to_ack)
            to_ack.clear()

    async def _settle_dead_consumers(self, stream: str) -> list[tuple[str, bytes, bytes]]:
        """A dead consumer's entries would wait forever: claim them to redo (without `reclaim`, drop them with it)."""
        claimed: list[tuple[str, bytes, bytes]] = []
        for consumer in await self._redis.xinfo_consumers(stream, self.group):
            name = consumer["name"].decode()
            if name == self.bus.name or await self.bus.is_alive(name):
                continue
            if consumer["pending"] and self.reclaim:
                claimed += await self._claim_from(stream, name)
            else:  # its pending entries go with it
                if consumer["pending"]:
                    log.warning("dropped %d entries %s held on %s", consumer["pending"], name, stream)
                await self._redis.xgroup_delconsumer(stream, self.group, name)
        return claimed

    async def _sweep_idle(self, stream: str) -> list[tuple[str, bytes, bytes]]:
        """Entries idle past `reclaim_idle_ms` are taken even from a live consumer: it is stuck on them."""
        if not self.reclaim:
            return []
        idle_ms = self.bus.cfg.reclaim_idle_ms
        _, swept, *_ = await self._redis.xautoclaim(stream, self.group, self.bus.name, idle_ms, count=100)
        if swept:
            log.warning("claimed %d entries idle over %d ms on %s", len(swept), idle_ms, stream)
        return [(stream, entry_id, fields.get(FIELD, b"")) for entry_id, fields in swept if fields]

    async def _claim_from(self, stream: str, dead: str) -> list[tuple[str, bytes, bytes]]:
        cfg = self.bus.cfg
        pending = await self._redis.xpending_range(stream, self.group, "-", "+", 100, consumername=dead)
        poison = [p["message_id"] for p in pending if p["times_delivered"] >= cfg.max_deliveries]
        retry = [p["message_id"] for p in pending if p["times_delivered"] < cfg.max_deliveries]
        out = []
        if retry:
            for entry_id, fields in await self._redis.xclaim(stream, self.group, self.bus.name, 0, retry):
                if fields:  # a trimmed entry comes back empty
                    out.append((stream, entry_id, fields.get(FIELD, b"")))
            log.warning("claimed %d entries of dead consumer %s on %s", len(out), dead, stream)
        if poison:
            for entry_id, fields in await self._redis.xclaim(stream, self.group, self.bus.name, 0, poison):
                await self._redis.xadd(
                    self.bus.keys.dead,
                    {b"stream": stream, b"group": self.group, b"id": entry_id, FIELD: fields.get(FIELD, b"")},
                    maxlen=cfg.stream_maxlen,
                )
            await self._redis.xack(stream, self.group, *poison)
            log.error("moved %d entries delivered %d+ times on %s to %s", len(poison), cfg.max_deliveries, stream, self.bus.keys.dead)
        return out

    async def _drop_dead_groups(self, stream: str, groups: list[dict]) -> list[dict]:
        """A group named after an instance (`role.id`) dies with it; left alone it would pin trimming.
        Its consumer exists from the group's creation: idle past the heartbeat TTL with no heartbeat
        is dead; a younger one may be an instance still starting. Returns the groups that remain."""
        ttl = self.bus.cfg.heartbeat_ttl_ms
        remaining = []
        for group in groups:
            name = group["name"].decode()
            if "." in name and name != self.group and group["consumers"] and not await self.bus.is_alive(name):
                consumers = await self._redis.xinfo_consumers(stream, name)
                if all(c["idle"] > ttl for c in consumers):
                    await self._redis.xgroup_destroy(stream, name)
                    log.warning("dropped group %s of a dead instance on %s", name, stream)
                    continue
            remaining.append(group)
        return remaining

    async def _trim(self, stream: str, groups: list[dict]) -> None:
        """Drop entries every group has acknowledged (Redis < 8.2 has no ACKED trimming)."""
        floor: bytes | None = None
        for group in groups:
            needed = group["last-delivered-id"]
            if group["pending"]:
                # The group may ack everything between the two calls: then min is None.
                needed = (await self._redis.xpending(stream, group["name"]))["min"] or needed
            if floor is None or id_key(needed) < id_key(floor):
                floor = needed
        if floor is not None and floor != b"0-0":
            await self._redis.xtrim(stream, minid=floor, approximate=True)


def id_key(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id as a sortable (milliseconds, sequence)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)
