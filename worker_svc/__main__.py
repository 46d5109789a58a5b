"""worker_svc: runs each step the scheduler plans, publishes one result per step.

1. Read Steps from the worker stream (group `worker`).
2. Run the step on the engine (`worker=fake` here; the JAX engine comes with the model code).
3. Publish one StepResult for the whole step to the results stream, which the scheduler and the
   detokenizer both read (each through its own consumer group).
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from jaxstream import protocol
from jaxstream.config import AppConfig
from jaxstream.model_files import load_tokenizer
from jaxstream.service import run
from jaxstream.transport import Bus
from worker_svc.fake import FakeEngine


async def main(cfg: AppConfig, bus: Bus) -> None:
    vocab_size = load_tokenizer(cfg.model).vocab_size
    engine = FakeEngine(cfg.scheduler.num_pages, cfg.scheduler.page_size, vocab_size)
    delay_s = cfg.worker.step_delay_ms / 1000
    inbox = bus.consumer([bus.keys.worker], protocol.decoder(protocol.WorkerInput))
    await inbox.ensure_groups(from_start=False)
    bus.start_heartbeat()
    async for batch in inbox.batches():
        for _, step in batch:
            started = time.perf_counter()
            result = engine.step(step)
            if delay_s:
                await asyncio.sleep(delay_s)
            result = msgspec.structs.replace(result, step_ms=(time.perf_counter() - started) * 1000)
            await bus.publish_many([(bus.keys.results, result)])  # missing after a Redis restart: dropped


if __name__ == "__main__":
    run("worker", main)
