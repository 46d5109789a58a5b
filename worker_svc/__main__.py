"""worker_svc: runs each step the scheduler plans, publishes one result per step.

1. Start up: `worker=jax` loads the weights, allocates the paged KV cache and compiles every step
   shape (progress bars on stderr, and the phase in `bus.phase`, which the gateway shows in its
   503s meanwhile); only then does the heartbeat start, so the stack reports ready once steps can
   run. `worker=fake` is the deterministic stand-in of `fake.py`.
2. Read Steps from its replica's worker stream (group `worker`): worker r (`parallelism.replica`)
   runs the steps of scheduler r, one data-parallel replica; `worker=fake` too. A reader task reads
   ahead while a step runs, so with overlap the next step is waiting when one ends. A dead worker's
   steps are dropped, never run by another: its KV cache died with it, and the scheduler ends the
   requests that ran on it.
3. Run each on the engine in a thread, so the heartbeat keeps beating through a long step, and
   measure the idle gap between decode steps (idle.py).
4. Between steps, in stream order, take what its scheduler relays of the RL control surface
   (control.py): stage new weights beside the live ones (read, pushed, or received from a
   trainer's collective group this worker joined), swap them in, set the weight version, release
   or resume device memory; each answered with a ControlReply on the results stream.
   Every StepResult names the weight version that computed it.
5. Publish one StepResult per step to the replica's results stream, which its scheduler and every
   detokenizer read (each through its own consumer group), in step order, from a task of its own:
   the next step starts without waiting for Redis. The heartbeat carries the stats: steps run,
   compilations since start-up (any is a bug), the idle gaps' median, p90 and p99.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec

from jaxstream import protocol
from jaxstream.config import AppConfig, ConfigError
from jaxstream.service import run
from jaxstream.transport import TRANSIENT, Bus, Consumer
from worker_svc.control import Control, DeviceControl, Source
from worker_svc.engine_api import StepEngine
from worker_svc.idle import IdleGaps
from worker_svc.slots import StaleStep

log = logging.getLogger(__name__)

# While steps follow each other, the stats (percentiles over the idle gaps) are refreshed once in
# this many; always when the worker runs out of steps.
STATS_EVERY = 32


def build(cfg: AppConfig, bus: Bus) -> StepEngine:
    """Runs in a thread: the event loop keeps publishing `bus.phase` meanwhile."""

    def phase(text: str) -> None:
        bus.phase = text

    if cfg.worker.kind == "fake":
        from jaxstream.model_files import tokenizer_vocab_size
        from worker_svc.fake import FakeEngine

        phase("reading the tokenizer's vocabulary size")
        vocab_size = tokenizer_vocab_size(cfg.model)
        return FakeEngine(cfg.scheduler.num_pages, cfg.scheduler.page_size, vocab_size, cfg.worker.step_delay_ms,
                          cfg.worker.enable_return_routed_experts)
    phase("starting JAX")
    started = time.perf_counter()
    from worker_svc.start import build_engine

    return build_engine(cfg, phase=phase, started=started)


async def main(cfg: AppConfig, bus: Bus) -> None:
    engine = await asyncio.to_thread(build, cfg, bus)
    replica = cfg.parallelism.replica
    # Steps are never taken over from a dead worker: their KV cache is gone, and the scheduler
    # forgets the steps it had sent (scheduler_svc.service.worker_lost).
    inbox = bus.consumer([bus.keys.worker(replica)], protocol.decoder(protocol.WorkerInput), reclaim=False)
    await inbox.ensure_groups(from_start=False)
    gaps = IdleGaps()
    dummy = cfg.worker.weights == "dummy" or cfg.model.path is None
    control = DeviceControl(engine, bus, replica, Source(None if dummy else cfg.model.path))
    await bus.put_value(bus.keys.weight_names, msgspec.json.encode(engine.weight_names()))
    await load_start_adapters(cfg, engine, bus)
    bus.stats = stats(engine, gaps, control)
    bus.start_heartbeat()
    steps: asyncio.Queue[protocol.Step | None] = asyncio.Queue()
    results: asyncio.Queue[protocol.StepResult | None] = asyncio.Queue()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(read(inbox, steps))
        tasks.create_task(publish(bus, bus.keys.results(replica), results))
        while (message := await steps.get()) is not None:
            if not isinstance(message, protocol.Step):  # a weight update, a collective group, a memory release
                answer = answered(message, control, engine, gaps, bus, results)
                if control.in_background(message):
                    tasks.create_task(answer)  # loading beside the steps
                else:
                    await answer  # between steps
                continue
            gaps.starting(message)
            try:
                result = await asyncio.to_thread(engine.step, message)
            except StaleStep as exc:  # nobody waits for its result: the scheduler forgot it with its worker
                log.warning("dropped: %s", exc)
                continue
            gaps.ended()
            results.put_nowait(msgspec.structs.replace(result, replica=replica, weight_version=control.version))
            if steps.empty() or gaps.total % STATS_EVERY == 0:  # not between two steps, at every one
                bus.stats = stats(engine, gaps, control)
        results.put_nowait(None)


async def answered(message: Control, control: DeviceControl, engine: StepEngine, gaps: IdleGaps,
                   bus: Bus, results: asyncio.Queue) -> None:
    results.put_nowait(await control.handle(message))
    bus.stats = stats(engine, gaps, control)
    with contextlib.suppress(*TRANSIENT):  # else the next heartbeat carries it
        await bus.beat()  # the new version is seen at once, not a heartbeat later


async def load_start_adapters(cfg: AppConfig, engine: StepEngine, bus: Bus) -> None:
    """worker.lora.adapters into their slots (LoraConfig.start_slots, where the scheduler places them),
    and their names where every gateway reads the loaded adapters (Bus.put_adapter)."""
    lora = cfg.worker.lora
    for name, slot in lora.start_slots().items():
        try:
            await asyncio.to_thread(engine.load_adapter, slot, lora.adapters[name])
        except ValueError as exc:
            raise ConfigError(f"worker.lora.adapters.{name}: {exc}") from None
        await bus.put_adapter(name, lora.adapters[name])


def stats(engine: StepEngine, gaps: IdleGaps, control: DeviceControl) -> protocol.WorkerStats:
    """The heartbeat's: the engine's, with the model's facts; the idle gaps'; the weights' and memory's."""
    return protocol.WorkerStats(facts=engine.facts, **engine.stats(), **gaps.stats(), **control.stats())


async def read(inbox: Consumer, steps: asyncio.Queue) -> None:
    """Every Step (and control message), in stream order, then None once the service is stopping."""
    async for batch in inbox.batches():
        for _, step in batch:
            steps.put_nowait(step)
    steps.put_nowait(None)


async def publish(bus: Bus, stream: str, results: asyncio.Queue) -> None:
    """Each StepResult, in order, until None."""
    while (result := await results.get()) is not None:
        await bus.publish_many([(stream, result)])  # missing after a Redis restart: dropped


if __name__ == "__main__":
    run("worker", main)
