"""Liveness beyond the heartbeat, against a real Redis: a live scheduler whose steps in flight have
had no result for its limit, and a live scheduler or detokenizer that leaves its streams' entries
unhandled for its limit, are stalled (test_health.py: /health names them), and `jaxstream up`
restarts their units."""

import asyncio
import os
import re
import sys
import time
from dataclasses import replace

import msgspec
import pytest

from jaxstream import protocol
from jaxstream.config import load_config
from jaxstream.transport import Bus, stalled_processes, stalls
from stack import launcher
from stack.launcher import Stack
from tests.integration.test_transport import DECODER, buses, config, stop
from tests.unit.test_protocol import MESSAGES

pytestmark = pytest.mark.integration

LIMITS = {"scheduler": 0.3, "detokenizer": 0.3}
STATS = next(m for m in MESSAGES[protocol.Stats] if isinstance(m, protocol.SchedulerStats))


def awaiting_since(since: float | None) -> protocol.SchedulerStats:
    return msgspec.structs.replace(STATS, awaiting_results_since=msgspec.UNSET if since is None else since)


def test_a_scheduler_with_steps_in_flight_and_no_result_past_its_limit_is_stalled(redis_url):
    cfg = replace(config(redis_url), heartbeat_ttl_ms=60_000)

    async def run():
        async with buses(cfg, "gateway") as (gateway,):
            wedged, busy, idle = (Bus(cfg, "scheduler", r) for r in range(3))
            for bus, since in ((wedged, time.time() - 100), (busy, time.time()), (idle, None)):
                await bus.connect()
                bus.stats = awaiting_since(since)
                await bus.beat()  # the stats a wedged loop last set, written by its heartbeat
            try:
                found = await stalls(gateway.redis, gateway.keys, 3, LIMITS)
                return wedged.name, found, await stalled_processes(cfg, 3, LIMITS)
            finally:
                for bus in (wedged, busy, idle):
                    await bus.close()

    name, found, processes = asyncio.run(run())
    assert found == {name: "no step result for 100 s with steps in flight"}
    assert processes == {os.getpid(): f"{name}: no step result for 100 s with steps in flight"}


def test_a_detokenizer_that_leaves_its_entries_unhandled_past_its_limit_is_stalled(redis_url):
    cfg = replace(config(redis_url), heartbeat_ttl_ms=60_000)

    async def run():
        async with buses(cfg, "detokenizer", "detokenizer", "detokenizer") as (holding, deaf, well):
            for bus in (holding, deaf, well):
                await bus.beat()
                consumer = bus.consumer([bus.keys.detokenizer(bus.name), bus.keys.results(0)], DECODER, group=bus.name)
                await consumer.ensure_groups(from_start=False)
                bus.batches = consumer.batches(idle=True)
                await anext(bus.batches)  # a first read: nothing yet
            for bus in (holding, deaf, well):
                await bus.publish(bus.keys.detokenizer(bus.name), stop("r"))
            await anext(holding.batches)  # handed over, never acknowledged: its handler never returns
            await anext(well.batches)
            await asyncio.sleep(0.4)
            await anext(well.batches)  # acknowledges, reads again: it does its work
            found = await stalls(well.redis, well.keys, 1, LIMITS)
            for bus in (holding, deaf, well):
                bus.closing = True
                await bus.batches.aclose()
            return holding.name, deaf.name, found

    holding, deaf, found = asyncio.run(run())
    assert set(found) == {holding, deaf}
    assert re.fullmatch(rf"an entry of t-\w+:stream:detokenizer:{holding} handed to it \d+ s ago is not handled", found[holding])
    assert re.fullmatch(rf"entries of t-\w+:stream:detokenizer:{deaf} wait and it has not read for \d+ s", found[deaf])


def test_jaxstream_up_restarts_the_unit_of_a_stalled_child_and_says_why(redis_url, monkeypatch, capsys):
    cfg = load_config(["worker=fake", f"redis.url={redis_url}"])
    stack = Stack(cfg, [])
    stack.redis_cfg = cfg.redis
    for name in ("scheduler", "worker", "detokenizer"):  # stand-ins that live until stopped
        stack.commands[name] = [sys.executable, "-c", "import time; time.sleep(60)"]
        stack.spawn(name)
    stalled = {stack.children["scheduler"].pid: "scheduler.0.c0ffee00: no step result for 75 s with steps in flight"}

    async def found(redis_cfg, replicas, limits):
        assert limits == {"scheduler": 60.0, "detokenizer": 30.0}  # server.*_stall_s
        return stalled

    monkeypatch.setattr(launcher, "stalled_processes", found)
    try:
        first = {name: child.pid for name, child in stack.children.items()}
        stack.supervise(100.0)
        assert stack.children["scheduler"].poll() is not None and stack.children["worker"].poll() is not None  # the replica
        assert stack.children["detokenizer"].poll() is None and stack.due == {"replica 0": 100.5}
        assert ("jaxstream: scheduler is stalled (scheduler.0.c0ffee00: no step result for 75 s with steps in flight); "
                "restarting replica 0 in 0.5 s") in capsys.readouterr().err
        stalled = {}
        stack.supervise(101.0)  # due: started again
        assert all(stack.children[n].poll() is None and stack.children[n].pid != first[n] for n in ("scheduler", "worker"))
    finally:
        stack.stopping.set()
        stack.stop()
