"""Liveness beyond the heartbeat: whether a live scheduler or detokenizer does the work it holds.

A heartbeat says a process runs; its loop may still be wedged (waiting for a message that will
never come) while its heartbeat task beats on. Two signs tell, read from Redis by whoever judges
(the gateway's /health, which answers 503 naming the instance; `jaxstream up`'s supervisor, which
restarts its unit), each against its role's limit (server.scheduler_stall_s, detokenizer_stall_s):

1. A scheduler with steps in flight that has absorbed no step result for longer than its limit:
   its stats say since when (SchedulerStats.awaiting_results_since: its own wall clock, written
   with its heartbeat, so a wedged loop's stays where it stopped), compared with this process's.
2. An instance that leaves entries of its input streams unhandled for longer than its limit:
   entries handed to it and not acknowledged since (XPENDING's idle time), or entries waiting
   while it has not read for that long (its consumer's idle time, XINFO CONSUMERS). Both by
   Redis's clock. Its input streams: a scheduler's, the replica's scheduler and results streams
   (group "scheduler"); a detokenizer's, its own and every replica's results stream (its group).

A stopped process (SIGSTOP, a paused VM) shows the same signs, but with the default limits, longer
than redis.heartbeat_ttl_ms, its heartbeat expires first: it is dead before it is stalled.
"""

from __future__ import annotations

import time

import msgspec

from jaxstream import protocol
from jaxstream.config import RedisConfig
from jaxstream.heartbeat import read_heartbeat
from jaxstream.names import Keys, replica_of, role_of
from jaxstream.transport.client import Redis, Refused, client
from jaxstream.transport.consumer import id_key

STATS = protocol.decoder(protocol.Stats)


async def stalls(redis: Redis, keys: Keys, replicas: int, limits: dict[str, float]) -> dict[str, str]:
    """Instance name -> why it is stalled, for every live instance of the roles in `limits`
    (role -> seconds: ServerConfig.stall_limits) that is."""
    prefix = keys.heartbeat("")
    names = sorted([key.decode().removeprefix(prefix) async for key in redis.scan_iter(match=prefix + "*", count=1000)])
    out: dict[str, str] = {}
    schedulers = [n for n in names if role_of(n) == "scheduler"] if "scheduler" in limits else []
    if schedulers:
        now = time.time()
        for name, raw in zip(schedulers, await redis.mget([keys.stats(n) for n in schedulers])):
            since = _awaiting_since(raw)
            if since is not None and now - since > limits["scheduler"]:
                out[name] = f"no step result for {now - since:.0f} s with steps in flight"
    for name in names:
        role = role_of(name)
        if role not in limits or name in out:
            continue
        if role == "scheduler":
            replica = replica_of(name) or 0
            streams, group = [keys.scheduler(replica), keys.results(replica)], "scheduler"
        elif role == "detokenizer":
            streams, group = [keys.detokenizer(name), *(keys.results(r) for r in range(replicas))], name
        else:
            continue
        if why := await _unhandled(redis, streams, group, name, limits[role]):
            out[name] = why
    return out


async def stalled_processes(cfg: RedisConfig, replicas: int, limits: dict[str, float]) -> dict[int, str]:
    """Process id -> "<instance>: why", for every stalled instance (`stalls`): what `jaxstream up`
    restarts."""
    redis = client(cfg, max_connections=1)
    try:
        keys = Keys(cfg.namespace)
        found = await stalls(redis, keys, replicas, limits)
        if not found:
            return {}
        beats = await redis.mget([keys.heartbeat(name) for name in found])
        return {pid: f"{name}: {why}" for (name, why), beat in zip(found.items(), beats)
                if beat and (pid := read_heartbeat(beat.decode())[0]) is not None}
    finally:
        await redis.aclose()


def _awaiting_since(raw: bytes | None) -> float | None:
    try:
        stats = STATS.decode(raw) if raw else None
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None  # another protocol: /health names that instead
    if isinstance(stats, protocol.SchedulerStats) and stats.awaiting_results_since is not msgspec.UNSET:
        return stats.awaiting_results_since
    return None


async def _unhandled(redis: Redis, streams: list[str], group: str, consumer: str, limit_s: float) -> str | None:
    """Why `consumer` (of `group`) holds or leaves entries of `streams` unhandled past `limit_s`; None if it does not."""
    limit_ms = int(limit_s * 1000)
    for stream in streams:
        try:
            if why := await _unhandled_in(redis, stream, group, consumer, limit_ms):
                return why
        except Refused:  # no such stream or group (yet, or any more, even between two calls): nothing waits there for it
            continue
    return None


async def _unhandled_in(redis: Redis, stream: str, group: str, consumer: str, limit_ms: int) -> str | None:
    me = next((c for c in await redis.xinfo_consumers(stream, group) if c["name"].decode() == consumer), None)
    if me is None:
        return None
    if me["pending"]:
        late = await redis.xpending_range(stream, group, "-", "+", 1, consumername=consumer, idle=limit_ms)
        if late:
            return f"an entry of {stream} handed to it {late[0]['time_since_delivered'] / 1000:.0f} s ago is not handled"
    if me["idle"] > limit_ms and await _undelivered(redis, stream, group):
        return f"entries of {stream} wait and it has not read for {me['idle'] / 1000:.0f} s"
    return None


async def _undelivered(redis: Redis, stream: str, group: str) -> bool:
    """Whether `stream` holds entries newer than any `group` was handed."""
    try:
        last = (await redis.xinfo_stream(stream))["last-generated-id"]
        delivered = next(g["last-delivered-id"] for g in await redis.xinfo_groups(stream) if g["name"].decode() == group)
    except (Refused, StopIteration):
        return False
    return id_key(last) > id_key(delivered)

