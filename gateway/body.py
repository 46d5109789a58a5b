"""A request body, read into JSON that every service can carry: the gateway's first line of checks.

1. The bytes are read chunk by chunk and refused (413) as soon as they pass `server.max_body_bytes`:
   a client cannot make the gateway hold more than that, whatever its Content-Length says. A
   client that stops sending for `server.body_timeout_s` gets a 408 and its connection closed; one
   that leaves before its body is whole is let go quietly (nobody is there to read an answer).
2. They are parsed as UTF-8 JSON. Python's parser accepts what the wire cannot carry, so
3. the parsed value is walked once, and its first bad value refused with a 400 naming where it is
   (`messages[0].content`, `sampling_params.seed`):
   - nesting deeper than `server.max_json_depth` (the parser itself stops near Python's recursion
     limit; what walks the body after it, json.dumps or a schema compiler, must never get that far);
   - an integer outside int64 (msgspec cannot encode past 2**64 - 1; a field with a tighter range,
     top_k or a token id, checks it where it is read, gateway/params.py);
   - NaN or an infinity (Python's json reads `NaN`, `Infinity` and `1e999`; JSON has no such numbers);
   - a lone UTF-16 surrogate in a string or a key (`"\\ud800"` is valid JSON but not Unicode: no
     UTF-8 encoder takes it). Refused, not replaced: what the client meant is unknown, and vLLM's
     and SGLang's pydantic validation refuses such a string too (`string_unicode`).
After this, a field reader only checks kinds and its own ranges.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any

from starlette.requests import ClientDisconnect, Request

from gateway.errors import ApiError, invalid
from jaxstream.config import ServerConfig

INT64 = (-(2**63), 2**63 - 1)
_SURROGATE = re.compile("[\ud800-\udfff]")
# Python refuses to read an integer of more digits than this (sys.get_int_max_str_digits); its
# ValueError comes out of json.loads as an unnamed failure, read again below to name the field.
_MOST_DIGITS = 20  # len(str(-2**63)) - 1


async def read_bounded(request: Request, max_bytes: int, refusal: str | None = None,
                       timeout_s: float = ServerConfig.body_timeout_s) -> bytes:
    """The request's body, refused (413, with `refusal` as its message when given) once over
    `max_bytes`, before reading the rest; a 408 when no byte of it comes for `timeout_s`; a 499
    (answered to nobody, logged by nobody) when the client left before sending it all."""
    message = refusal or f"the request body is larger than {max_bytes} bytes (server.max_body_bytes)"
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > max_bytes:
        raise ApiError(413, message, None, "request_too_large")
    chunks, total = [], 0
    stream = request.stream()
    try:
        while True:
            async with asyncio.timeout(timeout_s):
                chunk = await anext(stream, None)
            if chunk is None:
                return b"".join(chunks)
            total += len(chunk)
            if total > max_bytes:
                raise ApiError(413, message, None, "request_too_large")
            chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body stopped arriving: no byte of it for {timeout_s:g} s "
                            "(server.body_timeout_s)") from None
    except ClientDisconnect:
        raise ApiError(499, "the client disconnected while sending the request body") from None
    finally:
        await stream.aclose()


class _Huge:
    """An integer too long for Python to read: out of range, whatever it is."""


def parse_json(raw: bytes, max_depth: int = 128) -> dict[str, Any]:
    """`raw` as a JSON object every value of which the wire can carry (the module's story, 2-3)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid("the request body is not valid UTF-8") from None
    for parse_int in (None, _marked):  # the second time only for an integer of more digits than Python reads
        try:
            body = json.loads(text, parse_int=parse_int)
            break
        except json.JSONDecodeError as exc:
            raise invalid(f"the request body is not valid JSON: {exc.msg} at position {exc.pos}") from None
        except RecursionError:  # arrays or objects nested past Python's recursion limit
            raise invalid(f"the request body is nested too deeply (more than {max_depth} levels)") from None
        except ValueError:  # that integer: read again, marking it, so that the walk names its field
            continue
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    try:
        _check(body, 1, max_depth)
    except _Bad as bad:
        path = bad.path[-1:] if bad.problem == "deep" else reversed(bad.path)  # too deep: the top field is enough
        where = "".join(f"[{key}]" if isinstance(key, int) else f".{_printable(key)}" for key in path).lstrip(".")
        raise invalid(bad.message(where, max_depth), where or None) from None
    return body


def _marked(digits: str) -> int | _Huge:
    return int(digits) if len(digits.lstrip("-")) <= _MOST_DIGITS else _Huge()


def _printable(key: str) -> str:
    """A key as a message may name it: a surrogate in it escaped (the response must encode)."""
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


class _Bad(Exception):
    """The first value the wire cannot carry; `path` is filled in, innermost key first, as it unwinds."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.path: list[str | int] = []

    def message(self, where: str, max_depth: int) -> str:
        if self.problem == "deep":
            return f"the request body is nested too deeply (more than {max_depth} levels, in '{where}')"
        return f"'{where}' {self.problem}"


_OUT_OF_RANGE = f"is out of range: integers must be within -2**63..2**63-1 ({INT64[0]}..{INT64[1]})"


def _check_scalar(value: object) -> None:
    kind = type(value)
    if kind is str:
        if not value.isascii() and _SURROGATE.search(value):
            raise _Bad("holds a lone UTF-16 surrogate (such as \\ud800), which is not Unicode text")
    elif kind is int:
        if not INT64[0] <= value <= INT64[1]:
            raise _Bad(_OUT_OF_RANGE)
    elif kind is float:
        if not math.isfinite(value):
            spelled = "NaN" if math.isnan(value) else "-Infinity" if value < 0 else "Infinity (or a number too large for a double)"
            raise _Bad(f"must be a finite number, got {spelled}: JSON numbers are finite")
    elif kind is _Huge:
        raise _Bad(_OUT_OF_RANGE)


def _check(value: dict | list, depth: int, max_depth: int) -> None:
    """Raise _Bad for the first value of `value` (at nesting `depth`) the wire cannot carry."""
    if depth > max_depth:
        raise _Bad("deep")
    if type(value) is list and all(type(v) is int for v in value):  # token ids: the common long list
        if value and not (INT64[0] <= min(value) and max(value) <= INT64[1]):
            bad = _Bad(_OUT_OF_RANGE)
            bad.path.append(next(i for i, v in enumerate(value) if not INT64[0] <= v <= INT64[1]))
            raise bad
        return
    for key, item in value.items() if type(value) is dict else enumerate(value):
        try:
            if type(key) is str:
                _check_scalar(key)
            if type(item) is dict or type(item) is list:
                _check(item, depth + 1, max_depth)
            else:
                _check_scalar(item)
        except _Bad as bad:
            bad.path.append(key)
            raise
