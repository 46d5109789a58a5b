"""What the gateway refuses before a request goes to the tokenizer, from what it knows without
tokenizing it: a refusal that waited for the tokenizer would wait behind every prompt before it.

1. A text prompt longer than the context can hold in characters (jaxstream/prompt_limit.py): a 400
   naming the limit. The context is the tokenizer's max_model_len (its heartbeat facts), read
   again every FACTS_TTL_S. A chat's text is the tokenizer's to bound, once rendered.
2. A full queue: a 503 when every replica's scheduler already has scheduler.max_queued_requests
   waiting (its SchedulerStats); otherwise a replica with room is chosen. The stats are read at
   most every LOADS_TTL_S and are up to a heartbeat old: a replica they say is full is asked
   afresh (WriteStats, as /metrics does: a read begun after the request came, which the requests
   that came meanwhile share) before anything is refused on their word, so a queue that drained
   meanwhile turns nobody away. One that filled meanwhile lets a few through, which its
   scheduler refuses: its own check stays the final word.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Generic, TypeVar

from gateway.errors import ApiError
from jaxstream import protocol
from jaxstream.english import counted
from jaxstream.prompt_limit import CONTEXT_LENGTH_EXCEEDED, too_long

FACTS_TTL_S = 5.0  # the context only changes with the model, which a running stack does not
LOADS_TTL_S = 0.25  # a queue's length, which changes with every request

Loads = list[tuple[int, protocol.SchedulerStats]]  # (replica, its scheduler's stats)
T = TypeVar("T")


class Cached(Generic[T]):
    """A value read again once it is `ttl_s` old; a reader that comes during a read that started
    after it asked shares that read (ttl_s 0: each reader gets a read begun after it asked)."""

    def __init__(self, ttl_s: float, read: Callable[[], Awaitable[T]]) -> None:
        self.ttl_s, self.read = ttl_s, read
        self.value: T | None = None
        self.started = -math.inf  # monotonic time the value's read began
        self.reading = asyncio.Lock()

    async def get(self) -> T:
        asked = time.monotonic()
        async with self.reading:
            if self.started < asked - self.ttl_s:
                self.started = time.monotonic()
                self.value = await self.read()
        return self.value


class Admission:
    def __init__(self, max_model_len: Callable[[], Awaitable[int | None]],
                 loads: Callable[[bool], Awaitable[Loads]], chars_per_token: int) -> None:
        """`max_model_len()`: the tokenizer's context; `loads(fresh)`: each replica's scheduler
        stats, as last written (fresh=False) or asked for now (True)."""
        self.max_model_len = Cached(FACTS_TTL_S, max_model_len)
        self.written = Cached(LOADS_TTL_S, lambda: loads(False))
        self.fresh = Cached(0.0, lambda: loads(True))  # shared only by the requests that asked meanwhile
        self.chars_per_token = chars_per_token

    async def check_prompt(self, prompt: dict) -> None:
        """A 400 for a text prompt no context could hold (1.); `prompt`: GenerateRequest's fields."""
        text = prompt.get("text")
        if text is None or len(text) <= self.chars_per_token or prompt.get("truncate_prompt_tokens") is not None:
            return  # no text, one any context holds, or one the tokenizer cuts to fit
        limit = await self.max_model_len.get()
        if limit and (why := too_long(len(text), limit, self.chars_per_token)):
            raise ApiError(400, why, "prompt", CONTEXT_LENGTH_EXCEEDED)

    async def with_room(self, up: Collection[int]) -> list[int]:
        """The replicas of `up` whose queue has room (2.); a 503 when none has."""
        full = _full(await self.written.get(), up)
        if full:
            full = _full(await self.fresh.get(), full)
        if room := [r for r in up if r not in full]:
            return room
        waiting, limit = min(full.values())
        where = "" if len(full) == 1 else f" on each of the {len(full)} replicas"
        raise ApiError(503, f"the server is busy: {counted(waiting, 'request')} waiting{where}, the limit "
                            f"(scheduler.max_queued_requests) is {limit}; retry later")


def _full(loads: Loads, among: Collection[int]) -> dict[int, tuple[int, int]]:
    """replica -> (waiting, limit) of each replica of `among` whose stats say its queue is full."""
    return {r: (s.waiting, s.max_queued_requests) for r, s in loads
            if r in among and isinstance(s.max_queued_requests, int) and s.waiting >= s.max_queued_requests}
