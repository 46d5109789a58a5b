"""One request's life as the gateway sees it: submit, receive outputs, abort if left early."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway.errors import ApiError
from gateway.replies import Lost, ReplyRouter
from gateway.watchdog import Watchdog
from jaxstream import protocol
from jaxstream.transport import Bus, StreamMissing

log = logging.getLogger(__name__)


@dataclass
class Result:
    """The whole output of a request, accumulated from its RequestOutputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: protocol.FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, out: protocol.RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = out.completion_tokens or self.completion_tokens
        if out.finish is not None:
            self.finish = out.finish


class Engine:
    """The pipeline behind this gateway, as one call: `stream(request)` yields RequestOutputs."""

    def __init__(self, bus: Bus, router: ReplyRouter, watchdog: Watchdog) -> None:
        self.bus = bus
        self.router = router
        self.watchdog = watchdog
        self._aborts: set[asyncio.Task] = set()

    def new_rid(self) -> str:
        return uuid.uuid4().hex

    async def stream(self, rid: str, sampling: protocol.SamplingParams, **prompt) -> AsyncIterator[protocol.RequestOutput]:
        """Raises ApiError for a rejected request (before any output). Leaving the iteration
        before the final output (client gone, error) aborts the request in the pipeline."""
        if self.watchdog.missing and await self.watchdog.still_missing():
            raise ApiError(503, f"service unavailable: no {', '.join(self.watchdog.missing)} running")
        queue = self.router.open(rid)
        finished = False
        try:
            request = protocol.GenerateRequest(rid=rid, gateway=self.bus.name, sampling=sampling, **prompt)
            try:
                await self.bus.publish(self.bus.keys.tokenizer, request, wait_for_redis=False)
            except StreamMissing:
                finished = True  # never entered the pipeline
                raise ApiError(503, "the tokenizer service is not running") from None
            while True:
                match await queue.get():
                    case protocol.RequestRejected() as rejected:  # refused; held nowhere
                        finished = True
                        raise ApiError(rejected.status, rejected.message, rejected.param, rejected.code)
                    case Lost(message=message):  # `finished` stays False: abort what may remain
                        raise ApiError(503, message)
                    case protocol.RequestOutput() as out:
                        finished = out.finish is not None
                        yield out
                        if finished:
                            return
        finally:
            self.router.close(rid)
            if not finished:
                self.abort(rid, "client disconnected")

    def abort(self, rid: str, reason: str) -> None:
        # A task, not an await: this runs in `finally` of a cancelled handler too.
        message = protocol.AbortRequests((rid,), reason)
        task = asyncio.create_task(self.bus.publish_many([(self.bus.keys.scheduler, message)], wait_for_redis=False))
        self._aborts.add(task)
        task.add_done_callback(self._abort_sent)

    def _abort_sent(self, task: asyncio.Task) -> None:
        self._aborts.discard(task)
        if not task.cancelled() and task.exception() is not None:  # Redis down: its state goes anyway
            log.warning("abort not sent: %s", task.exception())


async def gather(outputs: AsyncIterator[protocol.RequestOutput]) -> Result:
    """A request's outputs added up, for a response that is not streamed."""
    result = Result()
    async for out in outputs:
        result.add(out)
    return result
