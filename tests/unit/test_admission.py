"""gateway/admission.py: what the gateway refuses before a request reaches the tokenizer (a text
prompt no context holds, a full queue), and how it reads the stats it decides by."""

import asyncio

import pytest

from gateway.admission import Admission, Cached
from gateway.errors import ApiError
from jaxstream import protocol
from tests.unit.test_metrics import replica_stats


def loads(*replicas: tuple[int, int | None]) -> list[tuple[int, protocol.SchedulerStats]]:
    """(replica, its stats) with `waiting` requests and that max_queued_requests (None: no limit)."""
    out = []
    for r, (waiting, limit) in enumerate(replicas):
        extra = {} if limit is None else {"max_queued_requests": limit}
        out.append((r, replica_stats(waiting=waiting, **extra)))
    return out


def admission(written, fresh=None, max_model_len=8192, chars_per_token=4) -> tuple[Admission, list[bool]]:
    asked: list[bool] = []

    async def read(now: bool):
        asked.append(now)
        return fresh if now else written

    async def context():
        return max_model_len

    return Admission(context, read, chars_per_token), asked


def test_a_text_prompt_no_context_holds_is_refused_naming_the_limit():
    gate, _ = admission([])
    asyncio.run(gate.check_prompt({"text": "x" * 32768}))  # 8192 tokens of 4 characters: may fit
    with pytest.raises(ApiError) as refused:
        asyncio.run(gate.check_prompt({"text": "x" * 32769}))
    error = refused.value
    assert error.status == 400 and error.param == "prompt" and error.code == "context_length_exceeded"
    assert "maximum context length is 8192 tokens" in error.message and "server.max_chars_per_token" in error.message
    for fine in ({"text": "x" * 40000, "truncate_prompt_tokens": 10},  # cut to fit by the tokenizer
                 {"messages": ()}, {"input_ids": (1,) * 9000}):  # a chat's bound is the tokenizer's, once rendered
        asyncio.run(gate.check_prompt(fine))


def test_a_queue_full_by_the_written_stats_is_asked_afresh_before_a_503():
    gate, asked = admission(loads((2, 2)), fresh=loads((0, 2)))  # drained since the heartbeat wrote its stats
    assert asyncio.run(gate.with_room([0])) == [0] and asked == [False, True]
    gate, asked = admission(loads((2, 2)), fresh=loads((3, 2)))
    with pytest.raises(ApiError) as refused:
        asyncio.run(gate.with_room([0]))
    assert refused.value.status == 503 and asked == [False, True]
    assert refused.value.message == ("the server is busy: 3 requests waiting, the limit (scheduler.max_queued_requests) "
                                     "is 2; retry later")


def test_a_replica_with_room_takes_what_a_full_one_cannot():
    full_and_free = loads((5, 5), (1, 5))
    gate, asked = admission(full_and_free, fresh=full_and_free)
    assert asyncio.run(gate.with_room([0, 1])) == [1]
    assert asyncio.run(gate.with_room([1])) == [1] and asked == [False, True]  # room by the written stats: no fresh read
    gate, _ = admission(loads((5, 5), (6, 5)), fresh=loads((5, 5), (6, 5)))
    with pytest.raises(ApiError, match="on each of the 2 replicas"):
        asyncio.run(gate.with_room([0, 1]))
    gate, asked = admission(loads((9, None)))  # no limit set
    assert asyncio.run(gate.with_room([0])) == [0] and asked == [False]


def test_cached_reads_at_most_once_a_ttl_and_shares_a_read_begun_after_a_reader_asked():
    reads = []

    async def read():
        reads.append(1)
        await asyncio.sleep(0.01)
        return len(reads)

    async def main():
        shared = Cached(60.0, read)
        assert await asyncio.gather(*(shared.get() for _ in range(5))) == [1] * 5 and len(reads) == 1
        assert await shared.get() == 1  # within its ttl
        reads.clear()
        each = Cached(0.0, read)
        first = asyncio.ensure_future(each.get())
        await asyncio.sleep(0)  # the first read has begun: those who ask now share the next one
        later = await asyncio.gather(*(each.get() for _ in range(4)))
        return await first, later

    first, later = asyncio.run(main())
    assert first == 1 and later == [2] * 4 and len(reads) == 2
