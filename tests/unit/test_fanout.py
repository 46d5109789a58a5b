"""Joining several choices' output streams: order, completion, and that every stream still running
is closed (which aborts its request in the pipeline) whatever way the HTTP request ends."""

import asyncio

import pytest

from gateway.errors import ApiError
from gateway.fanout import first_outputs, gather_all, merged
from jaxstream.protocol import FinishReason, RequestOutput

DONE = FinishReason("length", length=3)


class Stream:
    """A choice's outputs: `n` tokens, one per `delay` seconds; records whether it was closed early."""

    def __init__(self, rid: str, n: int, delay: float = 0.0, reject: bool = False) -> None:
        self.rid, self.n, self.delay, self.reject = rid, n, delay, reject
        self.closed_early = False
        self.gen = self._run()

    async def _run(self):
        finished = False
        try:
            if self.reject:
                raise ApiError(400, "bad", "prompt")
            for i in range(self.n):
                await asyncio.sleep(self.delay)
                finished = i == self.n - 1
                yield RequestOutput(self.rid, text=str(i), token_ids=(i,), finish=DONE if finished else None)
        finally:
            self.closed_early = not finished


def run(coro):
    return asyncio.run(coro)


def test_gather_all_returns_each_choice_in_order():
    streams = [Stream("a", 3, 0.002), Stream("b", 1)]
    results = run(gather_all([s.gen for s in streams]))
    assert [r.text for r in results] == ["012", "0"] and all(r.finish == DONE for r in results)


def test_a_rejected_choice_closes_the_others():
    async def go():
        streams = [Stream("a", 1000, 0.001), Stream("b", 1, reject=True)]
        with pytest.raises(ApiError):
            await gather_all([s.gen for s in streams])
        return streams

    streams = run(go())
    assert streams[0].closed_early


def test_first_outputs_rejection_closes_the_others():
    async def go():
        streams = [Stream("a", 1000, 0.001), Stream("b", 1, reject=True)]
        with pytest.raises(ApiError):
            await first_outputs([s.gen for s in streams])
        return streams

    assert run(go())[0].closed_early


def test_merged_yields_every_output_once_per_choice_and_ends():
    async def go():
        streams = [Stream("a", 4, 0.001), Stream("b", 2, 0.002), Stream("c", 1)]
        gens = [s.gen for s in streams]
        firsts = await first_outputs(gens)
        return [(i, out.text) async for i, out in merged(firsts, gens)], streams

    seen, streams = run(go())
    for index, n in enumerate((4, 2, 1)):
        assert [text for i, text in seen if i == index] == [str(k) for k in range(n)]
    assert not any(s.closed_early for s in streams)


def test_leaving_merged_early_closes_every_running_choice():
    async def go():
        streams = [Stream("a", 1000, 0.001), Stream("b", 1000, 0.001)]
        gens = [s.gen for s in streams]
        joined = merged(await first_outputs(gens), gens)
        async for _ in joined:
            break
        await joined.aclose()
        await asyncio.sleep(0.01)
        return streams

    assert all(s.closed_early for s in run(go()))
