"""Where a tokenizer's work runs: off its event loop, so one prompt delays only itself.

The loop only reads, hands out and publishes; the heartbeat beats on it whatever is being
tokenized. Rendering and tokenizing run in threads: the fast tokenizer releases the GIL while it
encodes, and the few Python-bound parts (a chat template, the id checks) are cut into the GIL's
time slices. Threads, not processes: the same throughput (docs/journal.md) without a copy of the
tokenizer per process, nor each prompt and its ids pickled across.

1. The small lane reads the tokenizer stream a batch at a time; each request of the batch runs in
   the small pool, and the batch's replies go out together once all are done (each small: the
   batch takes as long as its slowest).
2. A request whose prompt is larger than SMALL_CHARS (characters, or ids) would hold up its batch:
   it is handed to the large lane, by publishing it to a stream of its own, before the batch is
   acknowledged. So a large prompt never waits in a small batch, nor a small one behind a large
   (but just after a Redis restart, before the large lane has its stream again: then it runs in
   its batch rather than be lost).
3. The large lane reads that stream LARGE_AT_ONCE requests at a time (what bounds the memory a
   tokenizer spends on huge prompts), runs them in a pool of as many threads, and publishes each
   reply as soon as it is ready.
Both lanes acknowledge an entry only once its reply (or its hand-over) went out: a tokenizer that
dies mid-work leaves its entries pending, for the next one to claim (jaxstream/transport).
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import Executor, ThreadPoolExecutor

from jaxstream import protocol
from jaxstream.transport import Bus
from tokenizer_svc.preprocess import Preprocessor, Reply

# A prompt past this many characters (or token ids) would hold up a batch of small ones while it is
# tokenized: it goes to the large lane.
SMALL_CHARS = 1 << 16
LARGE_AT_ONCE = 2  # large prompts tokenized at once by one tokenizer; run more tokenizers for more
SMALL_THREADS = min(8, os.cpu_count() or 1)
DECODER = protocol.decoder(protocol.TokenizerInput)


def size(request: protocol.TokenizerInput) -> int:
    """What a request's work grows with: its characters (text, messages, tools) or its ids."""
    if isinstance(request, protocol.DetokenizeRequest):
        return len(request.token_ids)
    n = len(request.text or "") + len(request.tools or "") + len(getattr(request, "input_ids", None) or ())
    for message in request.messages or ():
        n += len(message.content) + sum(len(call.arguments) for call in message.tool_calls)
    return n


class Lanes:
    def __init__(self, bus: Bus, preprocess: Preprocessor) -> None:
        self.bus = bus
        self.preprocess = preprocess
        self.small = bus.consumer([bus.keys.tokenizer], DECODER)
        self.large = bus.consumer([bus.keys.tokenizer_large], DECODER, count=LARGE_AT_ONCE)
        self.small_pool = ThreadPoolExecutor(SMALL_THREADS, thread_name_prefix="tokenize")
        self.large_pool = ThreadPoolExecutor(LARGE_AT_ONCE, thread_name_prefix="tokenize-large")
        self.facts = preprocess.model_facts()
        self.processed = 0

    async def ensure_groups(self) -> None:
        for consumer in (self.small, self.large):
            await consumer.ensure_groups(from_start=False)

    def stats(self) -> protocol.TokenizerStats:
        return protocol.TokenizerStats(facts=self.facts, processed=self.processed,
                                       reclaimed=self.small.reclaimed + self.large.reclaimed)

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as lanes:  # one lane failing stops the other: the service dies whole
                lanes.create_task(self._small_lane(), name="small lane")
                lanes.create_task(self._large_lane(), name="large lane")
        finally:
            for pool in (self.small_pool, self.large_pool):
                pool.shutdown(wait=False, cancel_futures=True)

    async def _small_lane(self) -> None:
        async for batch in self.small.batches():
            requests = [request for _, request in batch]
            sizes = {id(r): size(r) for r in requests}  # a chat's walks its messages: once
            large = [r for r in requests if sizes[id(r)] > SMALL_CHARS]
            # Handed over before this batch is acknowledged (when the next is read), so never lost. With
            # no large stream to take them (Redis restarted, the large lane not back yet) they run here.
            if large and not await self.bus.publish_many([(self.bus.keys.tokenizer_large, r) for r in large]):
                requests = [r for r in requests if sizes[id(r)] <= SMALL_CHARS]
            pools = [self.large_pool if sizes[id(r)] > SMALL_CHARS else self.small_pool for r in requests]
            replies = await asyncio.gather(*(self._run(pool, r) for pool, r in zip(pools, requests)))
            await self._publish([route(self.bus, r, reply) for r, reply in zip(requests, replies)])

    async def _large_lane(self) -> None:
        async for batch in self.large.batches():
            await asyncio.gather(*(self._one(request) for _, request in batch))

    async def _one(self, request: protocol.TokenizerInput) -> None:
        await self._publish([route(self.bus, request, await self._run(self.large_pool, request))])

    async def _run(self, pool: Executor, request: protocol.TokenizerInput) -> Reply:
        return await asyncio.get_running_loop().run_in_executor(pool, self.preprocess, request)

    async def _publish(self, items: list[tuple[str, object]]) -> None:
        await self.bus.publish_many(items)
        self.processed += len(items)
        self.bus.stats = self.stats()


def route(bus: Bus, request: protocol.TokenizerInput, reply: Reply) -> tuple[str, object]:
    """A tokenized request goes to the scheduler of the replica the gateway chose; anything else
    (a refusal, a /tokenize answer) back to the request's gateway."""
    if isinstance(reply, protocol.TokenizedRequest):
        assert isinstance(request, protocol.GenerateRequest)
        return bus.keys.scheduler(request.replica), reply
    return bus.keys.gateway(request.gateway), reply
