"""The gateway's /health against a real Redis: every service instance's heartbeat carries the protocol
version it speaks, and an instance speaking another than the gateway's is named (503), never
tolerated, and logged once."""

import asyncio
import json
import logging
import os
from dataclasses import replace
from types import SimpleNamespace

import pytest

from gateway.app import Health
from jaxstream.heartbeat import heartbeat_value
from jaxstream.protocol import PROTOCOL_VERSION
from jaxstream.transport import Bus
from tests.integration.test_transport import buses, config

pytestmark = pytest.mark.integration


def test_health_names_each_instance_that_speaks_another_protocol(redis_url, caplog):
    cfg = replace(config(redis_url), heartbeat_ttl_ms=60_000)  # every heartbeat lives the whole test

    async def run():
        async with buses(cfg, "gateway", "tokenizer", "detokenizer") as (gateway, tokenizer, detokenizer):
            replica = [Bus(cfg, "scheduler", 0), Bus(cfg, "worker", 0)]
            for bus in replica:
                await bus.connect()
            try:
                for bus in (gateway, tokenizer, detokenizer, *replica):
                    await bus.beat()
                pipeline = SimpleNamespace(draining=False)
                health = Health(gateway, SimpleNamespace(done=lambda: False), 1, pipeline)
                answers = [await health.health(None)]
                scheduler, worker = replica
                # A scheduler of another build, and a worker whose heartbeat names no version at all
                await gateway.redis.set(gateway.keys.heartbeat(scheduler.name), heartbeat_value(os.getpid(), PROTOCOL_VERSION + 1))
                await gateway.redis.set(gateway.keys.heartbeat(worker.name), str(os.getpid()))
                answers += [await health.health(None), await health.health(None)]
                return scheduler.name, worker.name, answers
            finally:
                for bus in replica:
                    await bus.close()

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
