"""The Redis Streams transport: the only module that imports `redis`.

1. A service opens one `Bus` (its name is `<role>.<random>`, or `<role>.<replica>.<random>` for a
   scheduler or worker: each data-parallel replica has its own), which publishes messages with XADD
   (NOMKSTREAM, MAXLEN ~ cap), keeps a heartbeat key alive while the service is ready, and watches
   the epoch key to notice that Redis restarted. Before it is ready, a `starting` key says what its
   start-up is doing (`phase`), so that the gateway can tell a starting service from a missing one.
2. A service reads through `Consumer`s, each in a consumer group: the role's (its instances share
   the work) or the instance's own (it sees every entry; the group dies with the instance). Groups
   are created idempotently (MKSTREAM, BUSYGROUP ignored) and read with blocking XREADGROUP (BLOCK well under the socket timeout: redis-py 8
   defaults to a 5 s socket timeout). `Consumer.batches()` yields decoded messages and acks them only
   when the caller asks for the next batch, i.e. after its handler succeeded; the ack rides in one
   pipeline with the next read.
3. Housekeeping, about once per heartbeat, inside the read loop: entries pending on a consumer whose
   heartbeat expired are claimed (XPENDING + XCLAIM) and handled here; a backstop XAUTOCLAIM takes
   anything idle far longer than any handler runs; an entry delivered more than `max_deliveries` times
   goes to the dead-letter stream; the group of a dead instance is dropped; acknowledged entries
   are trimmed (XTRIM MINID below the oldest entry any group still needs), MAXLEN ~ on XADD being
   the hard memory cap.
4. Redis restart: the epoch key vanishes (no persistence) or changes. The bus bumps `generation` and
   calls its restart listeners (the gateway fails in-flight requests: their state is gone);
   consumers recreate their groups from id 0 (the streams are new, so 0 is everything written since).
   A lost group or stream (NOGROUP, "no such key") checks the epoch first: without a restart the
   group was dropped by a peer, and comes back reading from now on.
5. While Redis is unreachable, reads and publishes wait and retry; nothing raises into a service loop.
6. Besides streams, a few keys of shared state: the `hold` hash (why new requests wait at every
   gateway: a pause, a weight swap, released memory), `blob` parts (a weight update's tensors, too
   big for a message, with a TTL) and the worker's `weight_names`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from redis import asyncio as aioredis
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from jaxstream.config import ConfigError, RedisConfig
from jaxstream.keys import REDIS_PASSWORD_ENV
from jaxstream.protocol import encode

log = logging.getLogger(__name__)

FIELD = b"m"  # every stream entry has one field holding one msgpack message
TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


class StreamMissing(RuntimeError):
    """XADD NOMKSTREAM found no stream: its consumers are not there (not started, or Redis restarted)."""


class Keys:
    """Every key name, derived from the namespace so two stacks can share one Redis. A data-parallel
    replica (a scheduler+worker pair) has streams of its own: `scheduler(r)`, `worker(r)`, `results(r)`."""

    def __init__(self, namespace: str) -> None:
        ns = namespace
        self.tokenizer = f"{ns}:stream:tokenizer"
        self.dead = f"{ns}:stream:dead"
        self.epoch = f"{ns}:epoch"
        self._ns = ns

    def scheduler(self, replica: int) -> str:
        return f"{self._ns}:stream:scheduler:{replica}"

    def worker(self, replica: int) -> str:
        return f"{self._ns}:stream:worker:{replica}"

    def results(self, replica: int) -> str:
        return f"{self._ns}:stream:results:{replica}"

    def gateway(self, gateway_name: str) -> str:
        return f"{self._ns}:stream:gateway:{gateway_name}"

    def detokenizer(self, detokenizer_name: str) -> str:
        return f"{self._ns}:stream:detokenizer:{detokenizer_name}"

    def heartbeat(self, name: str) -> str:
        return f"{self._ns}:hb:{name}"

    def stats(self, name: str) -> str:
        return f"{self._ns}:stats:{name}"

    def starting(self, name: str) -> str:
        return f"{self._ns}:starting:{name}"

    def blob(self, name: str) -> str:
        """Bytes too big for a message (a weight update's tensors), in parts, with a TTL."""
        return f"{self._ns}:blob:{name}"

    @property
    def hold(self) -> str:
        """A hash: why new requests wait at every gateway (reason -> deadline, 0 for none)."""
        return f"{self._ns}:hold"

    @property
    def weight_names(self) -> str:
        """The model's checkpoint tensors (JSON), as the worker reads them: /list_weights."""
        return f"{self._ns}:weight_names"


# Roles with one instance group per data-parallel replica; their instance names carry the replica.
REPLICATED = ("scheduler", "worker")


def role_of(name: str) -> str:
    return name.split(".", 1)[0]


def typed_stats(stats: dict[str, dict[str, dict[str, str]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Bus.get_stats with each value as it was published: a Redis hash holds text, so an int or float
    comes back as its digits and JSON text (the tokenizer's facts: "[2]", "null", "true") as such;
    both are read back as JSON, and what is not JSON (a model_type) stays a string."""
    return {role: {name: {k: _stat_value(v) for k, v in s.items()} for name, s in instances.items()}
            for role, instances in stats.items()}


def _stat_value(text: str) -> Any:
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text


def replica_of(name: str) -> int | None:
    """The replica of a scheduler or worker instance (`worker.1.ab12cd34` -> 1); None for other roles."""
    parts = name.split(".")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def _client(cfg: RedisConfig, max_connections: int) -> aioredis.Redis:
    if not cfg.url:
        raise ConfigError("redis.url: not set (`jaxstream up` starts an embedded Redis; a lone service needs redis.url=redis://host:port)")
    pool = aioredis.BlockingConnectionPool.from_url(
        cfg.url,
        password=os.environ.get(REDIS_PASSWORD_ENV) or None,  # a password in the URL wins (redis-py)
        max_connections=max_connections,
        timeout=10,
        protocol=2,  # pin RESP2: RESP3 changes reply shapes
        socket_timeout=cfg.block_ms / 1000 + 5,  # above the longest BLOCK
        socket_connect_timeout=5,
        health_check_interval=0,
    )
    return aioredis.Redis(connection_pool=pool)


REMIND_S = 30.0  # while Redis stays unreachable, one line this often


class Outage:
    """Whether this process reaches Redis. One warning when it stops answering, one every REMIND_S
    while it stays down, one line when it is back: not a line per retry of every loop (a 30 s outage
    was 480 lines of a five-service stack)."""

    def __init__(self) -> None:
        self.since: float | None = None  # when it first failed, while it fails
        self.reminded = 0.0

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        if self.since is None:
            self.since = self.reminded = now
            log.warning("Redis unreachable (%s); retrying", exc)
        elif now - self.reminded >= REMIND_S:
            self.reminded = now
            log.warning("Redis still unreachable after %.0f s (%s); retrying", now - self.since, exc)

    def ok(self) -> None:
        if self.since is not None:
            log.warning("Redis reachable again after %.1f s", time.monotonic() - self.since)
            self.since = None

    def down_for(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since


async def forget_processes(cfg: RedisConfig, pids: set[int]) -> list[str]:
    """Delete the heartbeats, stats and start-up phases of the service instances these processes ran
    (they exited: `jaxstream up` saw it), so the others see them gone at their next look rather
    than a heartbeat TTL later: their requests fail, their entries are taken over, and /health no
    longer says one of them is starting. Returns the names of the instances that were beating."""
    keys = Keys(cfg.namespace)
    redis = _client(cfg, max_connections=1)
    try:
        prefix, starting_prefix = keys.heartbeat(""), keys.starting("")
        beats = [key async for key in redis.scan_iter(match=prefix + "*", count=1000)]
        values = await redis.mget(beats) if beats else []
        names = [key.decode().removeprefix(prefix) for key, pid in zip(beats, values) if pid and int(pid) in pids]
        phases = [key async for key in redis.scan_iter(match=starting_prefix + "*", count=1000)]
        values = await redis.mget(phases) if phases else []
        starting = [key for key, value in zip(phases, values) if value and _starting_parts(value.decode())[0] in pids]
        doomed = [k for name in names for k in (keys.heartbeat(name), keys.stats(name))] + starting
        if doomed:
            await redis.delete(*doomed)
        return names
    finally:
        await redis.aclose()


def _starting_value(pid: int, phase: str) -> str:
    """A `starting` key's value: the process id (what `forget_processes` matches), then the phase."""
    return f"{pid} {phase}"


def _starting_parts(value: str) -> tuple[int | None, str]:
    """(process id, phase) of a `starting` key's value; a value without a pid (written by a service
    of an earlier version) is all phase."""
    pid, _, phase = value.partition(" ")
    return (int(pid), phase) if pid.isdigit() else (None, value)


class Bus:
    """One service's connection: publishing, heartbeat, epoch, stats."""

    def __init__(self, cfg: RedisConfig, role: str, replica: int | None = None) -> None:
        self.cfg = cfg
        self.role = role
        self.replica = replica  # of a scheduler or worker
        self.name = f"{role}.{uuid.uuid4().hex[:8]}" if replica is None else f"{role}.{replica}.{uuid.uuid4().hex[:8]}"
        self.keys = Keys(cfg.namespace)
        self.redis = _client(cfg, max_connections=16)
        self.generation = 0  # bumped on every Redis restart noticed
        self.closing = False
        self.outage = Outage()
        # The service's main handles SIGTERM and SIGINT itself (the gateway drains first): jaxstream.service leaves them be.
        self.own_signals = False
        self._epoch: bytes | None = None
        self._restart_listeners: list[Callable[[], None]] = []
        self._heartbeat_task: asyncio.Task | None = None
        self._starting_task: asyncio.Task | None = None
        self.stats: dict[str, int | float | str] = {}
        # Held from taking `stats` to their write landing: a heartbeat that took older stats can then
        # not land after a newer immediate write (publish_many with_stats) and undo it.
        self._stats_written = asyncio.Lock()
        # What start-up is doing ("loading weights 10/272"), published until the heartbeat starts;
        # start-up code running in a thread may set it (one attribute store).
        self.phase = ""  # none yet: the service is merely starting
        self.started = time.monotonic()  # for "ready in N s"; a service sets its own start (service.STARTED)
        self._consumers: list[Consumer] = []

    async def connect(self, attempts: int = 50) -> None:
        for attempt in range(attempts):
            try:
                await self.redis.ping()
                break
            except AuthenticationError as exc:  # no retry brings the right password
                raise ConfigError(f"redis.url: Redis refused to let this service in ({exc}); its password comes "
                                  f"from {REDIS_PASSWORD_ENV}, or from the URL") from None
            except TRANSIENT:
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.2)
        self._epoch = await self._ensure_epoch()

    async def close(self) -> None:
        self.closing = True
        for task in (self._starting_task, self._heartbeat_task):
            if task:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        try:
            await self.redis.delete(self.keys.heartbeat(self.name), self.keys.stats(self.name), self.keys.starting(self.name))
        except TRANSIENT:
            pass
        for consumer in self._consumers:
            await consumer.close()
        await self.redis.aclose()

    # -- publishing ---------------------------------------------------------------------------

    async def publish(self, stream: str, message: Any, *, wait_for_redis: bool = True) -> None:
        """XADD one message; StreamMissing when the stream has no consumer group (its consumers
        never started, or Redis restarted and they have not recreated it yet)."""
        if await self.publish_many([(stream, message)], wait_for_redis=wait_for_redis):
            raise StreamMissing(stream)

    async def publish_many(self, items: list[tuple[str, Any]], *, wait_for_redis: bool = True,
                           with_stats: bool = False) -> list[str]:
        """XADD each (stream, message) in order, in one round trip. Returns the streams that were
        missing (their messages were dropped, the others still went out). `with_stats`: write this
        instance's `stats` first in the same round trip, for a change readers must see before the
        messages' effects reach a client (a request ended), not up to a heartbeat later.

        While Redis is unreachable this waits and retries (a service has nothing else to do then,
        and after a mere blip nothing is lost); after a restart the streams are missing and the
        messages dropped, as the state they belong to is gone. With wait_for_redis=False (an HTTP
        handler, which should answer at once) the transport error is raised instead."""
        with_stats = with_stats and bool(self.stats)
        if not items and not with_stats:
            return []
        payloads = [(stream, encode(message)) for stream, message in items]
        async with self._stats_written if with_stats else contextlib.nullcontext():
            return await self._publish(items, payloads, wait_for_redis, with_stats)

    async def _publish(self, items: list[tuple[str, Any]], payloads: list[tuple[str, bytes]], wait_for_redis: bool,
                       with_stats: bool) -> list[str]:
        while True:
            pipe = self.redis.pipeline(transaction=False)
            if with_stats:
                self._write_stats(pipe)
            for stream, payload in payloads:
                pipe.xadd(stream, {FIELD: payload}, maxlen=self.cfg.stream_maxlen, approximate=True, nomkstream=True)
            try:
                ids = (await pipe.execute())[2 if with_stats else 0 :]
                break
            except TRANSIENT as exc:
                if not wait_for_redis or self.closing:
                    raise
                self.outage.failed(exc)
                await asyncio.sleep(0.5)
        missing = sorted({stream for (stream, _), entry_id in zip(items, ids) if entry_id is None})
        if missing:
            log.warning("no such stream (consumers not started, or Redis restarted): %s", ", ".join(missing))
        return missing

    # -- liveness -----------------------------------------------------------------------------

    def on_restart(self, listener: Callable[[], None]) -> None:
        self._restart_listeners.append(listener)

    def report_starting(self) -> None:
        """Until `start_heartbeat`, publish `phase` once a heartbeat under the `starting` key (same TTL)."""
        self._starting_task = asyncio.create_task(self._starting_loop(), name=f"starting {self.name}")

    async def _stop_reporting_starting(self) -> None:
        """Ready: the start-up phase goes, once its loop has stopped (so no write of it lands after)."""
        if self._starting_task is None:
            return
        self._starting_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._starting_task
        self._starting_task = None
        with contextlib.suppress(*TRANSIENT):  # else it expires with its TTL
            await self.redis.delete(self.keys.starting(self.name))

    def start_heartbeat(self) -> None:
        """Call once the service is ready: from now on others see it alive."""
        log.info("ready in %.1f s", time.monotonic() - self.started)
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name=f"heartbeat {self.name}")

    async def _starting_loop(self) -> None:
        while not self.closing:
            try:
                await self.redis.set(self.keys.starting(self.name), _starting_value(os.getpid(), self.phase),
                                     px=self.cfg.heartbeat_ttl_ms)
            except TRANSIENT as exc:
                self.outage.failed(exc)
            await asyncio.sleep(self.cfg.heartbeat_ms / 1000)

    async def beat(self) -> None:
        ttl = self.cfg.heartbeat_ttl_ms
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.heartbeat(self.name), str(os.getpid()), px=ttl)
        pipe.get(self.keys.epoch)
        async with self._stats_written:
            if self.stats:
                self._write_stats(pipe)
            epoch = (await pipe.execute())[1]
        if epoch != self._epoch:
            self._epoch = await self._ensure_epoch()
            self.generation += 1
            log.warning("Redis restarted or was flushed (epoch changed): recreating state")
            for listener in self._restart_listeners:
                listener()

    def _write_stats(self, pipe: Any) -> None:
        """Two commands: the stats hash, expiring with the heartbeat."""
        pipe.hset(self.keys.stats(self.name), mapping=self.stats)
        pipe.pexpire(self.keys.stats(self.name), self.cfg.heartbeat_ttl_ms)

    async def _heartbeat_loop(self) -> None:
        await self._stop_reporting_starting()
        while not self.closing:
            try:
                await self.beat()
                self.outage.ok()
            except TRANSIENT as exc:
                self.outage.failed(exc)
            await asyncio.sleep(self.cfg.heartbeat_ms / 1000)

    async def _ensure_epoch(self) -> bytes:
        await self.redis.set(self.keys.epoch, uuid.uuid4().hex, nx=True)
        return await self.redis.get(self.keys.epoch)

    async def live_names(self) -> list[str]:
        """Names of every service instance whose heartbeat is fresh."""
        prefix = self.keys.heartbeat("")
        return [key.decode().removeprefix(prefix) async for key in self.redis.scan_iter(match=prefix + "*", count=1000)]

    async def starting(self) -> dict[str, str]:
        """The start-up phase of every service instance that is starting (not yet ready), by name."""
        prefix = self.keys.starting("")
        keys = [key async for key in self.redis.scan_iter(match=prefix + "*", count=1000)]
        phases = await self.redis.mget(keys) if keys else []
        return {key.decode().removeprefix(prefix): _starting_parts(value.decode())[1] for key, value in zip(keys, phases)
                if value is not None}

    async def delete_stream(self, stream: str) -> None:
        """Best effort, at shutdown: with Redis gone there is nothing left to delete from."""
        try:
            await self.redis.delete(stream)
        except TRANSIENT as exc:
            log.warning("could not delete %s (Redis unreachable: %s)", stream, exc)

    async def is_alive(self, name: str) -> bool:
        return bool(await self.redis.exists(self.keys.heartbeat(name)))

    # -- blobs and shared state ---------------------------------------------------------------

    async def put_blob(self, name: str, data: bytes | memoryview, part_bytes: int, ttl_s: float) -> tuple[str, ...]:
        """Store `data` in parts of at most `part_bytes` (a huge value would block Redis while it is
        copied); returns their keys, in order. They expire after `ttl_s` unless deleted first."""
        view = memoryview(data)
        keys = tuple(self.keys.blob(f"{name}:{i}") for i in range(max(1, -(-len(view) // part_bytes))))
        for i, key in enumerate(keys):  # one round trip per part: the pipeline would buffer them all
            await self.redis.set(key, bytes(view[i * part_bytes : (i + 1) * part_bytes]), px=int(ttl_s * 1000))
        return keys

    async def get_blob(self, keys: tuple[str, ...]) -> bytes | None:
        """The parts put by `put_blob`, joined; None when one has expired or is missing."""
        parts = [await self.redis.get(key) for key in keys]
        return None if any(p is None for p in parts) else b"".join(parts)

    async def delete_keys(self, keys: tuple[str, ...]) -> None:
        if keys:
            await self.redis.delete(*keys)

    async def holds(self) -> dict[str, float]:
        """Why new requests must wait now: reason -> deadline (time.time(); 0: until cleared)."""
        now = time.time()
        reasons = {k.decode(): float(v) for k, v in (await self.redis.hgetall(self.keys.hold)).items()}
        return {k: d for k, d in reasons.items() if d == 0 or d > now}

    async def set_hold(self, reason: str, seconds: float | None = None) -> None:
        """New requests wait at every gateway until `clear_hold(reason)`, or `seconds` (a holder that
        died must not hold them forever)."""
        await self.redis.hset(self.keys.hold, reason, 0 if seconds is None else time.time() + seconds)

    async def clear_hold(self, reason: str) -> None:
        await self.redis.hdel(self.keys.hold, reason)

    async def put_value(self, key: str, data: bytes) -> None:
        await self.redis.set(key, data)

    async def get_value(self, key: str) -> bytes | None:
        return await self.redis.get(key)

    # -- stats --------------------------------------------------------------------------------
    # `stats` is published with every heartbeat: cheap to update, at most one heartbeat stale; a
    # publish_many(with_stats=True) writes them at once (the scheduler, when a request starts or ends).

    async def get_stats(self, roles: tuple[str, ...]) -> dict[str, dict[str, dict[str, str]]]:
        """Stats of every live instance of these roles: role -> instance name -> stats."""
        names = [n for n in await self.live_names() if role_of(n) in roles]
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(self.keys.stats(name))
        out: dict[str, dict[str, dict[str, str]]] = {role: {} for role in roles}
        for name, raw in zip(names, await pipe.execute()):
            out[role_of(name)][name] = {k.decode(): v.decode() for k, v in raw.items()}
        return out

    def consumer(self, streams: list[str], decoder: msgspec.msgpack.Decoder, count: int = 256,
                 group: str | None = None, reclaim: bool = True) -> Consumer:
        """A consumer in the group of this role (shared work), or in a group of its own named after
        this instance (it sees every entry; the group dies with the instance). Without `reclaim`,
        what a dead member held is dropped, not taken over: for work that meant something only to
        the member that read it (a worker's steps, whose KV cache died with it)."""
        consumer = Consumer(self, streams, decoder, count, group or self.role, reclaim)
        self._consumers.append(consumer)  # closed with the bus
        return consumer


class Consumer:
    """A member of one consumer group, reading one or more streams."""

    def __init__(self, bus: Bus, streams: list[str], decoder: msgspec.msgpack.Decoder, count: int, group: str,
                 reclaim: bool = True) -> None:
        self.bus, self.streams, self.group = bus, streams, group
        self.decoder, self.count, self.reclaim = decoder, count, reclaim
        self._redis = _client(bus.cfg, max_connections=1)  # a blocked read holds its connection
        self._generation = -1
        self._next_housekeeping = 0.0
        self.reclaimed = 0  # entries taken over from dead or stuck consumers

    async def ensure_groups(self, from_start: bool) -> None:
        """Create the group on each stream. A stream that already exists (another stack run, an
        earlier process of ours) is read from now on ($); after a Redis restart, from 0."""
        for stream in self.streams:
            try:
                await self._redis.xgroup_create(stream, self.group, id="0" if from_start else "$", mkstream=True)
            except ResponseError as exc:
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
            except ResponseError as exc:
                # NOGROUP from reads, "no such key" from XINFO: our stream or group is gone
                if "NOGROUP" not in str(exc) and "no such key" not in str(exc):
                    raise
                await self._recreate_lost_group()
                continue
            except TRANSIENT as exc:
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
        pipe = self._redis.pipeline(transaction=False)
        self._queue_acks(pipe, to_ack)
        pipe.xreadgroup(self.group, self.bus.name, {s: ">" for s in self.streams}, count=self.count, block=self.bus.cfg.block_ms)
        replies = await pipe.execute()
        entries = []
        for stream, items in replies[-1] or []:
            stream = stream.decode()
            entries += [(stream, entry_id, fields.get(FIELD, b"")) for entry_id, fields in items]
        return entries

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
            if floor is None or _id_key(needed) < _id_key(floor):
                floor = needed
        if floor is not None and floor != b"0-0":
            await self._redis.xtrim(stream, minid=floor, approximate=True)


def _id_key(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)
