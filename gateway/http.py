"""HTTP plumbing: bodies, server-sent events, noticing a client that left, and a deadline on headers."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import h11
from starlette.requests import Request
from starlette.responses import StreamingResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.body import parse_json, read_bounded
from gateway.errors import ApiError


async def read_body(request: Request, *, empty_ok: bool = False) -> dict[str, Any]:
    """The request's JSON object, within the server's limits on size and depth (gateway/body.py);
    `empty_ok`: no body at all is `{}` (the control routes, which also take a GET)."""
    limits = request.app.state.limits  # ServerConfig, set by build_app
    raw = await read_bounded(request, limits.max_body_bytes, timeout_s=limits.body_timeout_s)
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


_LATE = b"the request's headers did not arrive in time (server.header_timeout_s)"
LATE_HEADERS = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(_LATE), _LATE))


class HeaderDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol (h11) with a deadline on each request's headers, which uvicorn
    lacks (its keep-alive timer runs only between requests, and any byte stops it): a connection
    whose request line and headers are not whole `header_timeout_s` after it opened, or after the
    first byte of its next request, gets a 408 and is closed. So connections that send their
    headers a byte at a time cannot pile up (server.header_timeout_s). The body's own deadline is
    gateway/body.py's. Named as the server's protocol class: `protocol_with(header_timeout_s)`."""

    header_timeout_s = 10.0
    _headers_due: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        if self._headers_due is None and self.conn.their_state is h11.IDLE:
            self._await_headers()  # the first byte of a kept-alive connection's next request
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the headers are whole (or the connection broke)
            self._stop_waiting()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._headers_due = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _stop_waiting(self) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None

    def _headers_late(self) -> None:
        self._headers_due = None
        if not self.transport.is_closing():
            self.transport.write(LATE_HEADERS)
            self.transport.close()


def protocol_with(header_timeout_s: float) -> type[HeaderDeadline]:
    """The protocol class for uvicorn.Config(http=...), with this deadline on headers."""
    return type("HeaderDeadline", (HeaderDeadline,), {"header_timeout_s": header_timeout_s})
