"""worker_svc: runs each step the scheduler plans, publishes one result per step.

1. Start up: `worker=jax` loads the weights, allocates the paged KV cache and compiles every step
   shape (progress bars on stderr); only then does the heartbeat start, so the stack reports
   ready once steps can run. `worker=fake` is the deterministic stand-in of `fake.py`.
2. Read Steps from its replica's worker stream (group `worker`): worker r (`parallelism.replica`)
   runs the steps of scheduler r, one data-parallel replica; `worker=fake` too.
3. Run each on the engine in a thread, so the heartbeat keeps beating through a long step.
4. Publish one StepResult for the whole step to the replica's results stream, which its scheduler
   and every detokenizer read (each through its own consumer group). The heartbeat carries the stats:
   steps run, and compilations since start-up (any is a bug).
"""

from __future__ import annotations

import asyncio

from jaxstream import protocol
from jaxstream.config import AppConfig
from jaxstream.service import run
from jaxstream.transport import Bus


def build(cfg: AppConfig):
    if cfg.worker.kind == "fake":
        from jaxstream.model_files import load_tokenizer
        from worker_svc.fake import FakeEngine

        vocab_size = load_tokenizer(cfg.model).vocab_size
        return FakeEngine(cfg.scheduler.num_pages, cfg.scheduler.page_size, vocab_size, cfg.worker.step_delay_ms)
    from worker_svc.start import build_engine

    return build_engine(cfg)


async def main(cfg: AppConfig, bus: Bus) -> None:
    engine = await asyncio.to_thread(build, cfg)
    replica = cfg.parallelism.replica
    inbox = bus.consumer([bus.keys.worker(replica)], protocol.decoder(protocol.WorkerInput))
    await inbox.ensure_groups(from_start=False)
    bus.stats = engine.stats()
    bus.start_heartbeat()
    async for batch in inbox.batches():
        for _, step in batch:
            result = await asyncio.to_thread(engine.step, step)
            await bus.publish_many([(bus.keys.results(replica), result)])  # missing after a Redis restart: dropped
            bus.stats = engine.stats()


if __name__ == "__main__":
    run("worker", main)
