"""The gateway's watchdog against a real Redis: a replica restarted between two of its periodic
checks serves the request that asked the watchdog to look again, instead of failing it at the next
check for the instances that stopped before it came."""

import asyncio
from dataclasses import replace

import pytest

from gateway.replicas import Replicas
from gateway.replies import ReplyRouter
from gateway.watchdog import Watchdog
from jaxstream.transport import Bus
from tests.integration.test_transport import buses, config

pytestmark = pytest.mark.integration


def test_a_request_admitted_after_a_restart_is_not_failed_for_the_instances_that_stopped_before_it(redis_url):
    cfg = replace(config(redis_url), heartbeat_ttl_ms=60_000)  # only closing or forgetting removes a heartbeat

    async def unit() -> list[Bus]:
        """A replica's scheduler and worker, beating once (the heartbeat lives the whole test)."""
        members = [Bus(cfg, "scheduler", 0), Bus(cfg, "worker", 0)]
        for bus in members:
            await bus.connect()
            await bus.beat()
        return members

    async def run():
        async with buses(cfg, "gateway") as (gateway,):
            router, replicas = ReplyRouter(gateway), Replicas(1)
            watchdog = Watchdog(gateway, router, replicas)
            scheduler, worker = await unit()
            await watchdog.check()
            assert watchdog.up == [0]
            await scheduler.close()  # it died: the supervisor forgets it at once
            await watchdog.check()  # the periodic check sees it
            assert watchdog.up == []
            await worker.close()  # its partner stopped, and the unit restarted before the next check
            restarted = await unit()
            await watchdog.look()  # what a request does while a replica is down (Generation._check_up)
            assert watchdog.up == [0]
            queue = router.open("after")
            replicas.assign("after", watchdog.up)
            await watchdog.check()  # the next periodic check
            assert queue.empty(), queue.get_nowait()
            for bus in restarted:
                await bus.close()
    asyncio.run(run())
