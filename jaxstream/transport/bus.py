"""A service's connection to Redis: publishing, its heartbeat and stats, liveness, shared state.

1. A service opens one `Bus` (its name is `<role>.<random>`, or `<role>.<replica>.<random>` for a
   scheduler or worker: jaxstream.names), which publishes messages with XADD (NOMKSTREAM, MAXLEN ~
   cap), keeps a heartbeat key alive while the service is ready, carrying the protocol version it
   speaks, and watches the epoch key to notice that Redis restarted. Before it is ready, a
   `starting` key says what its start-up is doing (`phase`), so that the gateway can tell a
   starting service from a missing one (jaxstream.heartbeat says what these keys hold). The
   reporter of the phase stops on its own once the service is ready, and the heartbeat starts
   whether or not it has: no loop here is ended by cancelling it (under Python 3.11, redis-py's
   send of a command with a socket timeout goes through asyncio.wait_for, which swallows a cancel
   that lands as the send completes: the reporter outlived its cancel and the heartbeat, waiting
   for it, never started).
2. Its `stats` (a protocol.Stats) go out with every heartbeat, and with a publish that asks
   (`with_stats`); `get_stats` reads every live instance's back with one typed decoder.
3. Redis restart: the epoch key vanishes (no persistence) or changes. The bus bumps `generation`
   and calls its restart listeners (the gateway fails in-flight requests: their state is gone);
   its consumers recreate their groups (consumer.py).
4. While Redis is unreachable, publishes wait and retry (`Outage` says so once); nothing raises
   into a service loop. A service loop's publishes go through a connection without a socket
   timeout (client.py): a process that stalls mid-publish reads the reply when it resumes, rather
   than give up on it and send the messages a second time. An HTTP handler's (wait_for_redis=False)
   keep a timeout: it answers its client an error, and retries nothing.
5. Besides streams, a few keys of shared state: the `hold` hash (why new requests wait at every
   gateway: a pause, a weight swap, released memory), `blob` parts (a weight update's tensors, too
   big for a message, with a TTL), the worker's `weight_names` and the LoRA `adapters` loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from jaxstream import protocol
from jaxstream.config import ConfigError, RedisConfig
from jaxstream.heartbeat import heartbeat_value, read_heartbeat, read_starting, starting_value
from jaxstream.keys import REDIS_PASSWORD_ENV
from jaxstream.names import Keys, role_of
from jaxstream.outage import Outage
from jaxstream.transport.client import TRANSIENT, Unauthorized, client
from jaxstream.transport.consumer import FIELD, Consumer
from jaxstream.transport.liveness import stalls

log = logging.getLogger(__name__)

STATS = protocol.decoder(protocol.Stats)  # every role's, tagged


class StreamMissing(RuntimeError):
    """XADD NOMKSTREAM found no stream: its consumers are not there (not started, or Redis restarted)."""


async def forget_processes(cfg: RedisConfig, pids: set[int]) -> list[str]:
    """Delete the heartbeats, stats and start-up phases of the service instances these processes ran
    (they exited: `jaxstream up` saw it), so the others see them gone at their next look rather
    than a heartbeat TTL later: their requests fail, their entries are taken over, and /health no
    longer says one of them is starting. Returns the names of the instances that were beating."""
    keys = Keys(cfg.namespace)
    redis = client(cfg, max_connections=1)
    try:
        prefix, starting_prefix = keys.heartbeat(""), keys.starting("")
        beats = [key async for key in redis.scan_iter(match=prefix + "*", count=1000)]
        values = await redis.mget(beats) if beats else []
        names = [key.decode().removeprefix(prefix) for key, value in zip(beats, values)
                 if value and read_heartbeat(value.decode())[0] in pids]
        phases = [key async for key in redis.scan_iter(match=starting_prefix + "*", count=1000)]
        values = await redis.mget(phases) if phases else []
        starting = [key for key, value in zip(phases, values) if value and read_starting(value.decode())[0] in pids]
        doomed = [k for name in names for k in (keys.heartbeat(name), keys.stats(name))] + starting
        if doomed:
            await redis.delete(*doomed)
        return names
    finally:
        await redis.aclose()


class Bus:
    """One service's connection: publishing, heartbeat, epoch, stats."""

    def __init__(self, cfg: RedisConfig, role: str, replica: int | None = None) -> None:
        self.cfg = cfg
        self.role = role
        self.replica = replica  # of a scheduler or worker
        self.name = f"{role}.{uuid.uuid4().hex[:8]}" if replica is None else f"{role}.{replica}.{uuid.uuid4().hex[:8]}"
        self.keys = Keys(cfg.namespace)
        self.redis = client(cfg, max_connections=16, name=self.name)
        self._loop_redis = client(cfg, max_connections=4, waits=True, name=self.name)  # a service loop's publishes (4.)
        self.generation = 0  # bumped on every Redis restart noticed
        self.closing = False
        self.outage = Outage()
        # The service's main handles SIGTERM and SIGINT itself (the gateway drains first): jaxstream.service leaves them be.
        self.own_signals = False
        self._epoch: bytes | None = None
        self._restart_listeners: list[Callable[[], None]] = []
        self._heartbeat_task: asyncio.Task | None = None
        self._starting_task: asyncio.Task | None = None
        self._ready = asyncio.Event()  # start_heartbeat: the start-up reporter ends
        self._closed = asyncio.Event()  # close: the heartbeat ends
        self.stats: protocol.Stats | None = None  # this instance's, published with each heartbeat
        self._unreadable: set[str] = set()  # instances whose stats did not decode, logged once
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
            except Unauthorized as exc:  # no retry brings the right password
                raise ConfigError(f"redis.url: Redis refused to let this service in ({exc}); its password comes "
                                  f"from {REDIS_PASSWORD_ENV}, or from the URL") from None
            except TRANSIENT:
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.2)
        self._epoch = await self._ensure_epoch()

    async def close(self) -> None:
        self.closing = True
        self._closed.set()
        # Each loop ends after the command it is in, which the socket timeout bounds: never cancelled (1.).
        tasks = {task for task in (self._starting_task, self._heartbeat_task) if task}
        if tasks:
            await asyncio.wait(tasks, timeout=self.cfg.block_ms / 1000 + 6)
        try:
            await self.redis.delete(self.keys.heartbeat(self.name), self.keys.stats(self.name), self.keys.starting(self.name))
        except TRANSIENT:
            pass
        for consumer in self._consumers:
            await consumer.close()
        await self._loop_redis.aclose()
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
        with_stats = with_stats and self.stats is not None
        if not items and not with_stats:
            return []
        payloads = [(stream, protocol.encode(message)) for stream, message in items]
        async with self._stats_written if with_stats else contextlib.nullcontext():
            return await self._publish(items, payloads, wait_for_redis, with_stats)

    async def _publish(self, items: list[tuple[str, Any]], payloads: list[tuple[str, bytes]], wait_for_redis: bool,
                       with_stats: bool) -> list[str]:
        redis = self._loop_redis if wait_for_redis else self.redis  # (4.)
        while True:
            pipe = redis.pipeline(transaction=False)
            if with_stats:
                self._write_stats(pipe)
            for stream, payload in payloads:
                pipe.xadd(stream, {FIELD: payload}, maxlen=self.cfg.stream_maxlen, approximate=True, nomkstream=True)
            try:
                ids = (await pipe.execute())[1 if with_stats else 0 :]
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
        """Ready: the start-up phase goes once its loop has ended (so no write of it lands after).
        The loop ends on its own after the command it is in: waited for, never cancelled (1.)."""
        task, self._starting_task = self._starting_task, None
        if task is None:
            return
        _, running = await asyncio.wait({task}, timeout=self.cfg.block_ms / 1000 + 6)
        if running:  # cannot happen while the socket timeout bounds its command; the heartbeat goes on
            log.error("the start-up reporter did not stop; its phase expires with its TTL")
            return
        with contextlib.suppress(*TRANSIENT):  # else it expires with its TTL
            await self.redis.delete(self.keys.starting(self.name))

    def start_heartbeat(self) -> None:
        """Call once the service is ready: from now on others see it alive."""
        log.info("ready in %.1f s", time.monotonic() - self.started)
        self._ready.set()
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name=f"heartbeat {self.name}")

    async def _starting_loop(self) -> None:
        while not (self.closing or self._ready.is_set()):
            try:
                await self.redis.set(self.keys.starting(self.name), starting_value(os.getpid(), self.phase),
                                     px=self.cfg.heartbeat_ttl_ms)
            except TRANSIENT as exc:
                self.outage.failed(exc)
            await _until(self._ready, self.cfg.heartbeat_ms / 1000)

    async def beat(self) -> None:
        ttl = self.cfg.heartbeat_ttl_ms
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.heartbeat(self.name), heartbeat_value(os.getpid(), protocol.PROTOCOL_VERSION), px=ttl)
        pipe.get(self.keys.epoch)
        async with self._stats_written:
            if self.stats is not None:
                self._write_stats(pipe)
            epoch = (await pipe.execute())[1]
        if epoch != self._epoch:
            self._epoch = await self._ensure_epoch()
            self.generation += 1
            log.warning("Redis restarted or was flushed (epoch changed): recreating state")
            for listener in self._restart_listeners:
                listener()

    def _write_stats(self, pipe: Any) -> None:
        """One command: the stats, expiring with the heartbeat."""
        pipe.set(self.keys.stats(self.name), protocol.encode(self.stats), px=self.cfg.heartbeat_ttl_ms)

    async def _heartbeat_loop(self) -> None:
        await self._stop_reporting_starting()
        while not self.closing:
            try:
                await self.beat()
                self.outage.ok()
            except TRANSIENT as exc:
                self.outage.failed(exc)
            await _until(self._closed, self.cfg.heartbeat_ms / 1000)

    async def _ensure_epoch(self) -> bytes:
        await self.redis.set(self.keys.epoch, uuid.uuid4().hex, nx=True)
        return await self.redis.get(self.keys.epoch)

    async def live_names(self) -> list[str]:
        """Names of every service instance whose heartbeat is fresh."""
        prefix = self.keys.heartbeat("")
        return [key.decode().removeprefix(prefix) async for key in self.redis.scan_iter(match=prefix + "*", count=1000)]

    async def stalls(self, replicas: int, limits: dict[str, float]) -> dict[str, str]:
        """Each stalled instance's name -> why (transport/liveness.py): what /health reports."""
        return await stalls(self.redis, self.keys, replicas, limits)

    async def live_protocols(self) -> dict[str, int | None]:
        """The protocol version every live instance speaks, by name (None: its heartbeat names none)."""
        prefix = self.keys.heartbeat("")
        keys = [key async for key in self.redis.scan_iter(match=prefix + "*", count=1000)]
        values = await self.redis.mget(keys) if keys else []
        return {key.decode().removeprefix(prefix): read_heartbeat(value.decode())[1] for key, value in zip(keys, values)
                if value is not None}

    async def starting(self) -> dict[str, str]:
        """The start-up phase of every service instance that is starting (not yet ready), by name."""
        prefix = self.keys.starting("")
        keys = [key async for key in self.redis.scan_iter(match=prefix + "*", count=1000)]
        phases = await self.redis.mget(keys) if keys else []
        return {key.decode().removeprefix(prefix): read_starting(value.decode())[1] for key, value in zip(keys, phases)
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

    # -- LoRA adapters: written by the worker (those loaded at start) and the gateway that loads or
    # unloads one, read by every gateway (so one sees another's load at once)

    async def put_adapter(self, name: str, path: str) -> None:
        await self.redis.hset(self.keys.adapters, name, path)

    async def delete_adapter(self, name: str) -> None:
        await self.redis.hdel(self.keys.adapters, name)

    async def adapters(self) -> dict[str, str]:
        """The adapters loaded, name -> path."""
        return {k.decode(): v.decode() for k, v in (await self.redis.hgetall(self.keys.adapters)).items()}

    # -- stats --------------------------------------------------------------------------------
    # `stats` is published with every heartbeat: cheap to update, at most one heartbeat stale; a
    # publish_many(with_stats=True) writes them at once (the scheduler, when a request starts or ends).

    async def get_stats(self, roles: tuple[str, ...]) -> dict[str, dict[str, protocol.Stats | None]]:
        """Stats of every live instance of these roles: role -> instance name -> stats; None for an
        instance that has published none, or none this bus can read (it speaks another protocol,
        which the gateway's /health names: logged here once)."""
        names = [n for n in await self.live_names() if role_of(n) in roles]
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.get(self.keys.stats(name))
        out: dict[str, dict[str, protocol.Stats | None]] = {role: {} for role in roles}
        for name, raw in zip(names, await pipe.execute(raise_on_error=False)):
            out[role_of(name)][name] = self._read_stats(name, raw)
        return out

    def _read_stats(self, name: str, raw: bytes | Exception | None) -> protocol.Stats | None:
        if raw is None:
            return None
        if isinstance(raw, Exception):  # a key of another type (WRONGTYPE): not what this protocol writes
            problem = str(raw)
        else:
            try:
                return STATS.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                problem = str(exc)
        if name not in self._unreadable:
            self._unreadable.add(name)
            log.error("the stats of %s do not decode (%s): read as none", name, problem)
        return None

    def consumer(self, streams: list[str], decoder: msgspec.msgpack.Decoder, count: int = 256,
                 group: str | None = None, reclaim: bool = True) -> Consumer:
        """A consumer in the group of this role (shared work), or in a group of its own named after
        this instance (it sees every entry; the group dies with the instance). Without `reclaim`,
        what a dead member held is dropped, not taken over: for work that meant something only to
        the member that read it (a worker's steps, whose KV cache died with it)."""
        consumer = Consumer(self, streams, decoder, count, group or self.role, reclaim)
        self._consumers.append(consumer)  # closed with the bus
        return consumer


async def _until(event: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, or less if `event` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()
