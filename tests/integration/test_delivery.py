"""Delivery that cannot lose a read, against a real Redis: a consumer whose process stalls while
Redis hands it entries still gets them when it resumes, one whose connection fails after Redis
delivered reads its own pending entries again before anything new, and a service's start-up
reporter stops on its own, so its heartbeat always starts."""

import asyncio
import random
import time
from dataclasses import replace

import pytest
from redis import Redis

from jaxstream import protocol
from jaxstream.transport import FIELD, Bus
from tests.integration.test_transport import DECODER, buses, config, stop
from tests.support import wait_for

pytestmark = pytest.mark.integration


def blocked_reader(redis: Redis, name: str) -> dict | None:
    """The connection of instance `name`'s consumer, blocked in XREADGROUP (CLIENT LIST)."""
    return next((c for c in redis.client_list() if c["name"] == name and c["cmd"] == "xreadgroup" and "b" in c["flags"]), None)


def test_a_consumer_stalled_past_the_old_socket_timeout_while_redis_hands_it_an_entry_still_gets_it(redis_url):
    # The wedge, in one process: Redis hands a blocked read an entry, then the event loop
    # cannot run (as under SIGSTOP, a VM pause, CPU throttling) for longer than the read's socket
    # timeout used to be (block_ms + 5 s). The old client gave up on the reply in its buffer, and
    # the entry waited in the pending list for the idle reclaim (60 s).
    cfg = config(redis_url, reclaim_idle_ms=600_000)
    sync = Redis.from_url(redis_url)
    entry = {FIELD: protocol.encode(stop("delivered, then the process stalled"))}

    async def run():
        async with buses(cfg, "scheduler") as (bus,):
            stream = bus.keys.scheduler(0)
            consumer = bus.consumer([stream], DECODER)
            await consumer.ensure_groups(from_start=False)
            batches = consumer.batches()
            reading = asyncio.ensure_future(anext(batches))
            # Synchronous from the XADD to the sleep: the consumer cannot read the reply meanwhile.
            # Its read blocks block_ms at a time: try again until one was blocked when the entry came.
            while not sync.xpending(stream, "scheduler")["pending"]:
                await asyncio.to_thread(wait_for, lambda: blocked_reader(sync, bus.name), 5, "the read to block", 0.01)
                sync.xadd(stream, entry)
            time.sleep(cfg.block_ms / 1000 + 5.5)
            batch = await asyncio.wait_for(reading, 3)
            bus.closing = True
            await batches.aclose()
            return batch

    assert [message for _, message in asyncio.run(run())] == [stop("delivered, then the process stalled")]


def test_after_a_read_error_a_consumer_reads_its_own_pending_entries_before_new_ones(redis_url):
    # Redis moved an entry to this consumer's pending list, but the reply never reached it (here:
    # another client read it under the consumer's name; in life, a connection that failed after
    # Redis delivered). After the error the consumer reads its pending list first, oldest first.
    cfg = replace(config(redis_url), reclaim_idle_ms=600_000)
    sync = Redis.from_url(redis_url)

    async def run():
        async with buses(cfg, "scheduler") as (bus,):
            stream = bus.keys.scheduler(0)
            consumer = bus.consumer([stream], DECODER, count=2)
            await consumer.ensure_groups(from_start=False)
            batches = consumer.batches()
            reading = asyncio.ensure_future(anext(batches))
            client = await asyncio.to_thread(wait_for, lambda: blocked_reader(sync, bus.name), 5, "the read to block")
            # Synchronous calls from here on: the consumer cannot run until the await below.
            sync.client_kill_filter(_id=client["id"])  # its read fails
            ids = [sync.xadd(stream, {FIELD: protocol.encode(stop(f"lost {i}"))}) for i in range(1, 5)]
            # Pending on this consumer, never seen by it: what Redis delivered before a connection failed.
            sync.xreadgroup("scheduler", bus.name, {stream: ">"})
            sync.xdel(stream, *ids[:2])  # two of them trimmed since: nothing left to handle, acked
            sync.xadd(stream, {FIELD: protocol.encode(stop("new"))})
            got = []
            batch = await asyncio.wait_for(reading, 5)
            while True:
                got += [message.rids[0] for _, message in batch]
                if "new" in got:
                    break
                batch = await asyncio.wait_for(anext(batches), 5)
            bus.closing = True
            await batches.aclose()
            return got, sync.xpending(stream, "scheduler")["pending"]

    # Two at a time (count): the two trimmed ones, then the others, oldest first, then what is new.
    assert asyncio.run(run()) == (["lost 3", "lost 4", "new"], 1)  # "new" acked with the next read


def test_the_start_up_reporter_stops_on_its_own_and_the_heartbeat_always_starts(redis_url):
    # jaxstream up's dp2 start that never became ready: a worker logged "ready", its heartbeat never
    # appeared, /health said "starting" for ten minutes. The start-up reporter was cancelled while
    # redis-py sent its SET through asyncio.wait_for (Python 3.11), which swallows a cancel that
    # lands as the send completes: the reporter went on, and the heartbeat waited for it forever.
    # Reporting every millisecond, a start-up meets that moment often (6 in 100 did before).
    cfg = replace(config(redis_url), heartbeat_ms=1, heartbeat_ttl_ms=5000)

    async def start_up() -> bool:
        bus = Bus(cfg, "worker", 0)
        await bus.connect()
        try:
            bus.report_starting()
            for _ in range(random.randrange(1, 40)):
                await asyncio.sleep(0)
            bus.start_heartbeat()
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                if await bus.redis.exists(bus.keys.heartbeat(bus.name)) and not await bus.redis.exists(bus.keys.starting(bus.name)):
                    return True
                await asyncio.sleep(0.005)
            return False
        finally:
            await asyncio.wait_for(bus.close(), 10)

    async def run():
        return [await start_up() for _ in range(100)]

    started = asyncio.run(run())
    assert started.count(False) == 0, f"{started.count(False)} of 100 start-ups never beat"
