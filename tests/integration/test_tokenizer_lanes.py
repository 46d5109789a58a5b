"""tokenizer_svc/lanes.py against a real Redis: a large prompt goes through the large lane while small
ones are answered meanwhile, every entry is acknowledged once answered, and with no large stream
(Redis restarted, the large lane not back yet) a large prompt is done in its own batch."""

import asyncio
import threading
import uuid

import pytest

from jaxstream import protocol
from jaxstream.config import RedisConfig
from jaxstream.transport import Bus
from tokenizer_svc.lanes import SMALL_CHARS, Lanes, size

pytestmark = pytest.mark.integration
FACTS = protocol.TokenizerFacts(max_model_len=8, vocab_size=10, eos_token_ids=(), bos_token_id=None, has_chat_template=False)


class Held:
    """A preprocessor whose large requests wait for `release` (a prompt that takes long to tokenize);
    each answer carries the length of its text."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def model_facts(self) -> protocol.TokenizerFacts:
        return FACTS

    def __call__(self, request: protocol.TokenizeRequest) -> protocol.TokenizeReply:
        if size(request) > SMALL_CHARS:
            assert self.release.wait(10)
        return protocol.TokenizeReply(request.rid, token_ids=(len(request.text),), max_model_len=8)


def test_a_large_prompt_holds_up_nothing_but_itself(redis_url):
    cfg = RedisConfig(url=redis_url, namespace=f"t-{uuid.uuid4().hex[:8]}", block_ms=200, heartbeat_ms=100, heartbeat_ttl_ms=300)
    held = Held()

    async def run():
        tokenizer, gateway = Bus(cfg, "tokenizer"), Bus(cfg, "gateway")
        for bus in (tokenizer, gateway):
            await bus.connect()
        lanes = Lanes(tokenizer, held)
        await lanes.ensure_groups()
        replies = gateway.consumer([gateway.keys.gateway(gateway.name)], protocol.decoder(protocol.GatewayInput))
        await replies.ensure_groups(from_start=False)
        running = asyncio.create_task(lanes.run())
        answers = replies.batches()

        async def answer() -> protocol.TokenizeReply:
            return (await asyncio.wait_for(anext(answers), 10))[0][1]

        def ask(rid: str, chars: int) -> tuple[str, protocol.TokenizeRequest]:
            return tokenizer.keys.tokenizer, protocol.TokenizeRequest(rid, gateway.name, text="x" * chars)

        try:
            await gateway.publish_many([ask("large", SMALL_CHARS + 1), ask("small", 5)])
            first = await answer()  # the large one still being tokenized
            held.release.set()
            second = await answer()
            large_stream = await tokenizer.redis.xlen(tokenizer.keys.tokenizer_large)
            await asyncio.sleep(0.5)  # a lane acknowledges its batch with its next read
            pending = [(await tokenizer.redis.xpending(stream, "tokenizer"))["pending"]
                       for stream in (tokenizer.keys.tokenizer, tokenizer.keys.tokenizer_large)]
            # No large stream (as after a Redis restart, until the large lane recreates it): the hand-over
            # finds none, and the small lane does the work itself.
            publish, refused = tokenizer.publish_many, []

            async def no_large_stream(items, **kwargs):
                if items and all(stream == tokenizer.keys.tokenizer_large for stream, _ in items):
                    refused.append(len(items))  # dropped, as XADD NOMKSTREAM drops them: the large lane never sees it
                    return [tokenizer.keys.tokenizer_large]
                return await publish(items, **kwargs)

            tokenizer.publish_many = no_large_stream
            await gateway.publish_many([ask("large again", SMALL_CHARS + 2)])
            third = await answer()
            handed = refused
            return first, second, large_stream, pending, (third, handed), lanes.processed
        finally:
            tokenizer.closing = gateway.closing = True
            held.release.set()
            await asyncio.wait_for(running, 5)
            await answers.aclose()
            for bus in (tokenizer, gateway):
                await bus.close()

    first, second, large_stream, pending, third, processed = asyncio.run(run())
    assert (first.rid, first.token_ids) == ("small", (5,))
    assert (second.rid, second.token_ids) == ("large", (SMALL_CHARS + 1,))
    assert large_stream == 1 and pending == [0, 0]  # handed over once; every entry acknowledged once answered
    (third, handed) = third
    assert (third.rid, third.token_ids) == ("large again", (SMALL_CHARS + 2,)) and handed == [1] and processed == 3
