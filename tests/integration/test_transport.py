"""The Redis transport against a real Redis server: groups, acks, reclaim, dead letters, trimming,
restart detection. Each test uses its own namespace."""

import asyncio
import contextlib
import json
import os
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from redis import Redis

from jaxstream import protocol
from jaxstream.config import ConfigError, RedisConfig
from jaxstream.heartbeat import as_json
from jaxstream.keys import REDIS_PASSWORD_ENV
from jaxstream.redis_server import EmbeddedRedis
from jaxstream.transport import Bus, StreamMissing, forget_processes

pytestmark = pytest.mark.integration

DECODER = protocol.decoder(protocol.SchedulerInput)


def config(redis_url: str, **overrides) -> RedisConfig:
    return RedisConfig(url=redis_url, namespace=f"t-{uuid.uuid4().hex[:8]}", block_ms=200, heartbeat_ms=100,
                       heartbeat_ttl_ms=300, **overrides)


def stop(rid: str) -> protocol.StopRequests:
    return protocol.StopRequests((rid,))


@contextlib.asynccontextmanager
async def buses(cfg: RedisConfig, *roles: str):
    """Connected buses, closed (with their consumers) however the test ends."""
    opened = [Bus(cfg, role) for role in roles]
    try:
        for bus in opened:
            await bus.connect()
        yield opened
    finally:
        for bus in opened:
            await bus.close()


async def next_batch(consumer, timeout: float = 5.0):
    batches = consumer.batches()
    return batches, await asyncio.wait_for(anext(batches), timeout)


def test_publish_to_a_stream_without_consumers_is_refused(redis_url):
    async def run():
        async with buses(config(redis_url), "gateway") as (bus,):
            with pytest.raises(StreamMissing):
                await bus.publish(bus.keys.scheduler(0), stop("x"))
    asyncio.run(run())


def test_stats_travel_typed_with_the_heartbeat(redis_url):
    facts = protocol.TokenizerFacts(max_model_len=8192, vocab_size=49152, eos_token_ids=(2,), bos_token_id=None,
                                    has_chat_template=True)

    async def run():
        async with buses(config(redis_url), "tokenizer", "gateway") as (bus, gateway):
            bus.stats = protocol.TokenizerStats(facts=facts, processed=3, reclaimed=0)
            await bus.beat()
            await gateway.beat()  # beats, publishes no stats
            return bus.name, gateway.name, await gateway.get_stats(("tokenizer", "gateway")), await gateway.live_protocols()

    tokenizer, gateway, stats, protocols = asyncio.run(run())
    assert stats == {"tokenizer": {tokenizer: protocol.TokenizerStats(facts=facts, processed=3, reclaimed=0)},
                     "gateway": {gateway: None}}
    assert json.loads(json.dumps(as_json(stats["tokenizer"][tokenizer]))) == {"max_model_len": 8192, "vocab_size": 49152, "eos_token_ids": [2],
                                                      "bos_token_id": None, "has_chat_template": True, "processed": 3,
                                                      "reclaimed": 0}  # what /stats shows
    assert as_json(stats["gateway"][gateway]) == {}
    assert protocols == {tokenizer: protocol.PROTOCOL_VERSION, gateway: protocol.PROTOCOL_VERSION}  # the heartbeat says


def test_stats_that_do_not_decode_read_as_none_logged_once(redis_url, caplog):
    async def run():
        async with buses(config(redis_url), "worker", "detokenizer", "gateway") as (other, garbled, gateway):
            for bus in (other, garbled):
                await bus.beat()
            await gateway.redis.hset(gateway.keys.stats(other.name), "steps", "3")  # not what this protocol writes
            await gateway.redis.set(gateway.keys.stats(garbled.name), protocol.encode(protocol.StopRequests(("a",))))
            first = await gateway.get_stats(("worker", "detokenizer"))
            return other.name, garbled.name, first, await gateway.get_stats(("worker", "detokenizer"))

    other, garbled, first, again = asyncio.run(run())
    assert first == again == {"worker": {other: None}, "detokenizer": {garbled: None}}
    logged = [r.getMessage() for r in caplog.records if "do not decode" in r.getMessage()]
    assert len(logged) == 2 and any(other in m for m in logged) and any(garbled in m for m in logged)


def test_stats_written_at_once_with_a_publish(redis_url):
    async def run():
        async with buses(config(redis_url), "detokenizer") as (bus,):
            consumer = bus.consumer([bus.keys.scheduler(0)], DECODER)
            await consumer.ensure_groups(from_start=False)
            await bus.beat()
            bus.stats = protocol.DetokenizerStats(requests=1, started=1)  # no heartbeat loop runs: only the publish writes them
            missing = await bus.publish_many([(bus.keys.scheduler(0), stop("a")), ("nowhere", stop("b"))], with_stats=True)
            return missing, await bus.get_stats(("detokenizer",))

    missing, stats = asyncio.run(run())
    assert missing == ["nowhere"] and list(stats["detokenizer"].values()) == [protocol.DetokenizerStats(requests=1, started=1)]


def test_ack_only_after_the_handler_succeeds(redis_url):
    cfg = config(redis_url)

    async def run():
        async with buses(cfg, "scheduler") as (bus,):
            consumer = bus.consumer([bus.keys.scheduler(0)], DECODER)
            await consumer.ensure_groups(from_start=False)
            await consumer.ensure_groups(from_start=False)  # idempotent
            await bus.publish(bus.keys.scheduler(0), stop("a"))
            batches, batch = await next_batch(consumer)
            assert batch == [(bus.keys.scheduler(0), stop("a"))]
            pending = await bus.redis.xpending(bus.keys.scheduler(0), "scheduler")
            assert pending["pending"] == 1  # handed out, not yet acked: the handler has not returned
            await batches.aclose()  # the handler "raised": no ack
            assert (await bus.redis.xpending(bus.keys.scheduler(0), "scheduler"))["pending"] == 1
            # a handler that returns gets its batch acked on the next read
            await bus.publish(bus.keys.scheduler(0), stop("b"))
            batches, batch = await next_batch(consumer)
            assert batch == [(bus.keys.scheduler(0), stop("b"))]
            bus.closing = True
            async for _ in batches:
                pass
            assert (await bus.redis.xpending(bus.keys.scheduler(0), "scheduler"))["pending"] == 1  # only "a"
    asyncio.run(run())


def test_entries_of_a_dead_consumer_are_claimed_by_a_live_one(redis_url):
    cfg = config(redis_url)

    async def run():
        async with buses(cfg, "tokenizer", "tokenizer") as (dead, live):
            live.start_heartbeat()  # `dead` never beats: to the others it is gone
            taker = dead.consumer([dead.keys.scheduler(0)], DECODER)
            await taker.ensure_groups(from_start=False)
            await dead.publish(dead.keys.scheduler(0), stop("orphan"))
            _, batch = await next_batch(taker)  # taken, never acked
            assert batch[0][1] == stop("orphan")
            rescuer = live.consumer([live.keys.scheduler(0)], DECODER)
            batches, batch = await next_batch(rescuer)
            assert batch == [(live.keys.scheduler(0), stop("orphan"))]
            assert rescuer.reclaimed == 1
            live.closing = True
            async for _ in batches:
                pass
            assert (await live.redis.xpending(live.keys.scheduler(0), "tokenizer"))["pending"] == 0
    asyncio.run(run())


def test_an_entry_delivered_too_often_goes_to_the_dead_letter_stream(redis_url):
    cfg = config(redis_url, max_deliveries=2)

    async def run():
        async with buses(cfg, "tokenizer", "tokenizer", "tokenizer") as (first, second, live):
            c1 = first.consumer([first.keys.scheduler(0)], DECODER)
            await c1.ensure_groups(from_start=False)
            await first.publish(first.keys.scheduler(0), stop("poison"))
            await next_batch(c1)  # delivery 1, then "crash"
            c2 = second.consumer([second.keys.scheduler(0)], DECODER)
            await next_batch(c2)  # claimed: delivery 2, then "crash" again
            live.start_heartbeat()
            c3 = live.consumer([live.keys.scheduler(0)], DECODER)
            batches = c3.batches()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(anext(batches), 1.5)  # never handed out a third time
            dead = await live.redis.xrange(live.keys.dead)
            assert len(dead) == 1 and dead[0][1][b"stream"] == live.keys.scheduler(0).encode()
            assert DECODER.decode(dead[0][1][b"m"]) == stop("poison")
            assert (await live.redis.xpending(live.keys.scheduler(0), "tokenizer"))["pending"] == 0
    asyncio.run(run())


def test_acknowledged_entries_are_trimmed(redis_url):
    cfg = config(redis_url)

    async def run():
        async with buses(cfg, "scheduler") as (bus,):
            bus.start_heartbeat()
            consumer = bus.consumer([bus.keys.scheduler(0)], DECODER, count=50)
            await consumer.ensure_groups(from_start=False)
            for i in range(0, 2000, 100):
                await bus.publish_many([(bus.keys.scheduler(0), stop(str(j))) for j in range(i, i + 100)])
            seen = 0
            async for batch in consumer.batches():
                seen += len(batch)
                if seen >= 2000:
                    break
            await consumer._ack([(bus.keys.scheduler(0), (await bus.redis.xrevrange(bus.keys.scheduler(0), count=1))[0][0])])
            consumer._next_housekeeping = 0
            await consumer._housekeeping([])
            assert seen == 2000
            assert await bus.redis.xlen(bus.keys.scheduler(0)) < 200  # approximate trimming keeps a node or so
    asyncio.run(run())


def test_a_redis_restart_is_noticed_and_groups_come_back(redis_url):
    cfg = config(redis_url)

    async def run():
        async with buses(cfg, "scheduler") as (bus,):
            restarts = []
            bus.on_restart(lambda: restarts.append(bus.generation))
            consumer = bus.consumer([bus.keys.scheduler(0)], DECODER)
            await consumer.ensure_groups(from_start=False)
            # what a restart without persistence leaves: none of our keys
            keys = [k async for k in bus.redis.scan_iter(match=cfg.namespace + ":*")]
            await bus.redis.delete(*keys)
            await bus.beat()
            assert restarts == [1]
            batches = consumer.batches()
            reader = asyncio.ensure_future(anext(batches))
            for _ in range(50):  # the consumer recreates its group; then the stream takes messages again
                try:
                    await bus.publish(bus.keys.scheduler(0), stop("after"))
                    break
                except StreamMissing:
                    await asyncio.sleep(0.05)
            batch = await asyncio.wait_for(reader, 5)
            assert batch == [(bus.keys.scheduler(0), stop("after"))]
            await batches.aclose()
    asyncio.run(run())


def test_works_on_this_redis_version(redis_url):
    version = Redis.from_url(redis_url).info("server")["redis_version"]
    assert tuple(int(x) for x in version.split(".")[:2]) >= (6, 2), version


def test_trimming_survives_a_group_that_acks_between_two_calls(redis_url):
    """XINFO GROUPS saw pending entries, XPENDING then found none (min is None): seen in a run."""
    cfg = config(redis_url)

    async def run():
        async with buses(cfg, "scheduler") as (bus,):
            consumer = bus.consumer([bus.keys.scheduler(0)], DECODER)
            await consumer.ensure_groups(from_start=False)
            await bus.publish(bus.keys.scheduler(0), stop("a"))
            batches, _ = await next_batch(consumer)  # one pending entry
            await bus.redis.xgroup_create(bus.keys.scheduler(0), "another", id="0")  # two groups, as on results

            async def acked_meanwhile(*args, **kwargs):
                return {"pending": 0, "min": None, "max": None, "consumers": []}

            consumer._redis.xpending = acked_meanwhile
            await consumer._trim(bus.keys.scheduler(0), await bus.redis.xinfo_groups(bus.keys.scheduler(0)))  # must not raise
            await batches.aclose()
    asyncio.run(run())


def test_a_dead_instances_own_group_is_dropped_a_young_one_kept(redis_url):
    cfg = config(redis_url)

    async def run():
        async with buses(cfg, "detokenizer", "detokenizer", "scheduler") as (dead, young, me):
            me.start_heartbeat()
            stream = me.keys.results(0)
            mine = me.consumer([stream], DECODER)
            await mine.ensure_groups(from_start=False)
            theirs = dead.consumer([stream], DECODER, group=dead.name)
            await theirs.ensure_groups(from_start=False)  # then it dies, before its first read
            await asyncio.sleep(cfg.heartbeat_ttl_ms / 1000 + 0.2)  # its consumer idles past the TTL
            await young.consumer([stream], DECODER, group=young.name).ensure_groups(from_start=False)  # just started
            await mine._drop_dead_groups(stream, await me.redis.xinfo_groups(stream))
            names = {g["name"].decode() for g in await me.redis.xinfo_groups(stream)}
            assert names == {"scheduler", young.name}
    asyncio.run(run())


def test_a_dropped_group_comes_back_without_replaying_the_past(redis_url):
    cfg = config(redis_url)

    async def run():
        async with buses(cfg, "detokenizer") as (bus,):
            consumer = bus.consumer([bus.keys.results(0)], DECODER, group=bus.name)
            await consumer.ensure_groups(from_start=False)
            await bus.publish_many([(bus.keys.results(0), stop(f"old{i}")) for i in range(3)])
            batches, batch = await next_batch(consumer)
            assert len(batch) == 3
            await bus.redis.xgroup_destroy(bus.keys.results(0), bus.name)  # taken for dead by a peer
            reader = asyncio.ensure_future(anext(batches))
            await asyncio.sleep(0.5)  # NOGROUP, group recreated from now on
            await bus.publish(bus.keys.results(0), stop("new"))
            assert await asyncio.wait_for(reader, 5) == [(bus.keys.results(0), stop("new"))]
            await batches.aclose()
    asyncio.run(run())


def test_housekeeping_on_a_vanished_stream_recreates_it(redis_url):
    """Seen after a real Redis restart: XINFO on a stream that no longer exists says "no such key"."""
    cfg = config(redis_url)

    async def run():
        async with buses(cfg, "scheduler") as (bus,):
            consumer = bus.consumer([bus.keys.scheduler(0)], DECODER)
            await consumer.ensure_groups(from_start=False)
            await bus.redis.delete(bus.keys.scheduler(0))
            consumer._next_housekeeping = 0  # housekeeping runs first in the next round
            batches = consumer.batches()
            reader = asyncio.ensure_future(anext(batches))
            for _ in range(50):
                try:
                    await bus.publish(bus.keys.scheduler(0), stop("back"))
                    break
                except StreamMissing:
                    await asyncio.sleep(0.05)
            assert await asyncio.wait_for(reader, 5) == [(bus.keys.scheduler(0), stop("back"))]
            await batches.aclose()
    asyncio.run(run())


def test_a_password_protected_redis_is_reached_with_the_password_from_the_environment(monkeypatch):
    # `jaxstream up` gives its embedded Redis a random password in a file (not in its arguments) and
    # hands it to every service in JAXSTREAM_REDIS_PASSWORD; the URL carries none.
    password = "0123abcd" * 4
    with EmbeddedRedis(password=password) as server:
        assert password not in Path(f"/proc/{server.process.pid}/cmdline").read_text() and password not in server.url
        cfg = RedisConfig(url=server.url, namespace="t-password")

        async def write() -> None:
            async with buses(cfg, "tokenizer") as (bus,):
                await bus.put_value("k", b"v")

        monkeypatch.delenv(REDIS_PASSWORD_ENV, raising=False)
        with pytest.raises(ConfigError, match=f"redis.url: Redis refused .* {REDIS_PASSWORD_ENV}"):
            asyncio.run(write())  # at once: no retry brings the password
        monkeypatch.setenv(REDIS_PASSWORD_ENV, password)
        asyncio.run(write())
        assert Redis.from_url(server.url, password=password).get("k") == b"v"


def test_forgetting_a_dead_process_removes_its_heartbeat_and_its_start_up_phase(redis_url):
    """What `jaxstream up` does when a child exits: the others see it gone at once, a starting one too."""
    cfg = replace(config(redis_url), heartbeat_ttl_ms=60_000)  # only the forgetting removes anything

    async def run():
        async with buses(cfg, "tokenizer", "worker") as (ready, starting):
            await ready.beat()
            starting.phase = "compiling step shapes 3/9"
            starting.report_starting()
            for _ in range(100):
                if await starting.starting():
                    break
                await asyncio.sleep(0.01)
            before = (await ready.live_names(), await ready.starting())
            # Another process's instance, starting: not forgotten.
            await ready.redis.set(ready.keys.starting("worker.other"), f"{os.getpid() + 1} loading weights 2/3")
            names = await forget_processes(cfg, {os.getpid()})  # both buses are this process's
            return before, names, (await ready.live_names(), await ready.starting())

    (live, phases), names, after = asyncio.run(run())
    assert len(live) == 1 and live[0].startswith("tokenizer.") and list(phases.values()) == ["compiling step shapes 3/9"]
    assert names == live and after == ([], {"worker.other": "loading weights 2/3"})
