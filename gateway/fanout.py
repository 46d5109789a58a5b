"""Several pipeline requests answering one HTTP request: `n` samples, a batch of prompts.

Each choice is its own request in the pipeline (its own rid); this joins them back. Whatever
way the HTTP request ends, every choice still running is closed, which aborts it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gateway.generation import Result, gather
from jaxstream import protocol

Outputs = AsyncIterator[protocol.RequestOutput]


async def gather_all(streams: list[Outputs]) -> list[Result]:
    """Every choice's whole result. The first rejection cancels (aborts) the others and is raised."""
    tasks = [asyncio.ensure_future(gather(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def first_outputs(streams: list[Outputs]) -> list[protocol.RequestOutput]:
    """Each choice's first output, so that a rejection becomes an HTTP error before a 200 stream
    starts. On a rejection every stream is closed (aborting the others) and the error raised."""
    try:
        return list(await asyncio.gather(*(anext(s) for s in streams)))
    except BaseException:
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
        raise


async def merged(firsts: list[protocol.RequestOutput], streams: list[Outputs]) -> AsyncIterator[tuple[int, protocol.RequestOutput]]:
    """(choice index, output) as they come, each choice's `firsts` entry first. Ends when every
    choice has finished; an error in one ends all (closing the rest) and is raised."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: Outputs) -> None:
        try:
            async for out in stream:
                await queue.put((index, out))
            await queue.put((index, done))
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, cancellation included
            await queue.put((index, exc))
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, (f, s) in enumerate(zip(firsts, streams)) if f.finish is None]
    try:
        for index, first in enumerate(firsts):
            if first.finish is not None:
                await streams[index].aclose()
            yield index, first
        live = len(tasks)
        while live:
            index, item = await queue.get()
            if item is done:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
