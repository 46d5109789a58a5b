"""HTTP plumbing: bodies, server-sent events, and noticing a client that left."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from gateway.body import parse_json, read_bounded
from gateway.errors import ApiError


async def read_body(request: Request, *, empty_ok: bool = False) -> dict[str, Any]:
    """The request's JSON object, within the server's limits on size and depth (gateway/body.py);
    `empty_ok`: no body at all is `{}` (the control routes, which also take a GET)."""
    limits = request.app.state.limits  # ServerConfig, set by build_app
    raw = await read_bounded(request, limits.max_body_bytes)
    if not raw and empty_ok:
        return {}
    return parse_json(raw, limits.max_json_depth)


class QuietDisconnects(logging.Filter):
    """Drops asyncio's "socket.send() raised exception." (a warning per write after a client's
    connection is lost, from the event loop's transport): a client leaving mid-stream is ordinary,
    and the stream's end already aborts its request."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "socket.send() raised exception."


class EventStream(StreamingResponse):
    """SSE whose iterator is always closed when the response ends, disconnect included: closing it
    closes the request's output stream, which aborts the request in the pipeline."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def sse_response(events: AsyncIterator[str]) -> EventStream:
    async def frames() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {event}\n\n"
        except ApiError as exc:  # after the 200 went out: an error event, then [DONE]
            yield f"data: {json.dumps(exc.body())}\n\n"
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"

    return EventStream(frames(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def until_disconnect(request: Request, work: Coroutine) -> Any:
    """Run `work`, cancelling it if the client disconnects first (Starlette only notices that for
    streaming responses)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # its request is aborted as the cancellation unwinds it
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ApiError(499, "client disconnected")  # nobody reads this
    return task.result()
