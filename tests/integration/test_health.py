"""The gateway's /health against a real Redis: every service instance's heartbeat carries the protocol
version it speaks, and an instance speaking another than the gateway's is named (503), never
tolerated, and logged once; so is an instance that is alive but stalled."""

import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from gateway.app import Health
from jaxstream.heartbeat import heartbeat_value
from jaxstream.protocol import PROTOCOL_VERSION
from jaxstream.transport import Bus
from tests.integration.test_liveness import LIMITS, awaiting_since
from tests.integration.test_transport import buses, config

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def live_pipeline(cfg):
    """A live instance of every role (replica 0's scheduler and worker), each beaten once, and the
    gateway's Health: yields (health, gateway, scheduler, worker)."""
    async with buses(cfg, "gateway", "tokenizer", "detokenizer") as (gateway, tokenizer, detokenizer):
        scheduler, worker = Bus(cfg, "scheduler", 0), Bus(cfg, "worker", 0)
        try:
            for bus in (scheduler, worker):
                await bus.connect()
            for bus in (gateway, tokenizer, detokenizer, scheduler, worker):
                await bus.beat()
            health = Health(gateway, SimpleNamespace(done=lambda: False), 1, SimpleNamespace(draining=False), LIMITS)
            yield health, gateway, scheduler, worker
        finally:
            for bus in (scheduler, worker):
                await bus.close()


def test_health_names_each_instance_that_speaks_another_protocol(redis_url, caplog):
    cfg = replace(config(redis_url), heartbeat_ttl_ms=60_000)  # every heartbeat lives the whole test

    async def run():
        async with live_pipeline(cfg) as (health, gateway, scheduler, worker):
            answers = [await health.health(None)]
            # A scheduler of another build, and a worker whose heartbeat names no version at all
            await gateway.redis.set(gateway.keys.heartbeat(scheduler.name), heartbeat_value(os.getpid(), PROTOCOL_VERSION + 1))
            await gateway.redis.set(gateway.keys.heartbeat(worker.name), str(os.getpid()))
            answers += [await health.health(None), await health.health(None)]
            return scheduler.name, worker.name, answers

    with caplog.at_level(logging.ERROR, logger="gateway.app"):
        scheduler, worker, (ok, mismatched, again) = asyncio.run(run())
    assert (ok.status_code, json.loads(ok.body)) == (200, {"status": "ok"})
    assert mismatched.status_code == again.status_code == 503 and mismatched.body == again.body
    assert json.loads(mismatched.body) == {
        "status": "unhealthy", "missing": [], "starting": {},
        "mismatched": [f"{scheduler}: protocol {PROTOCOL_VERSION + 1}, this gateway speaks {PROTOCOL_VERSION}",
                       f"{worker}: no protocol version, this gateway speaks {PROTOCOL_VERSION}"]}
    logged = [r.getMessage() for r in caplog.records if "this gateway speaks" in r.getMessage()]
    assert len(logged) == 2 and logged[0].startswith(scheduler) and logged[1].startswith(worker)  # once each


def test_health_names_a_stalled_instance_by_role_and_logs_it_once(redis_url, caplog):
    cfg = replace(config(redis_url), heartbeat_ttl_ms=60_000)

    async def run():
        async with live_pipeline(cfg) as (health, gateway, scheduler, worker):
            scheduler.stats = awaiting_since(time.time() - 75)  # what its wedged loop last set
            await scheduler.beat()
            answers = [await health.health(None), await health.health(None)]
            scheduler.stats = awaiting_since(None)  # a result came: it goes on
            await scheduler.beat()
            return scheduler.name, [*answers, await health.health(None)]

    with caplog.at_level(logging.ERROR, logger="gateway.app"):
        name, (stalled, again, ok) = asyncio.run(run())
    assert stalled.status_code == again.status_code == 503 and stalled.headers["retry-after"]
    assert json.loads(stalled.body) == {"status": "unhealthy", "missing": [], "starting": {},
                                        "stalled": {"scheduler": "no step result for 75 s with steps in flight"}}
    assert (ok.status_code, json.loads(ok.body)) == (200, {"status": "ok"})
    logged = [r.getMessage() for r in caplog.records if "is stalled" in r.getMessage()]
    assert logged == [f"{name} is stalled: no step result for 75 s with steps in flight"]
