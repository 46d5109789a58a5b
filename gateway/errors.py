"""Errors as OpenAI's nested error object, with the HTTP status.

`code` is what OpenAI's is: a string naming the problem where OpenAI has one ("model_not_found",
"context_length_exceeded", "invalid_type"), else null; never the HTTP status (that is the status line)."""

from __future__ import annotations

import json
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               503: "service_unavailable", 500: "internal_server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {
            "message": self.message,
            "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
            "param": self.param,
            "code": self.code,
        }}

    def response(self) -> JSONResponse:
        # 401 is only ever a key refusal here (gateway/auth.py): say which scheme, as RFC 6750 asks; after a
        # 408 the rest of the body may still trickle in: the connection closes
        headers = {503: {"Retry-After": "1"}, 401: {"WWW-Authenticate": "Bearer"}, 408: {"Connection": "close"}}.get(self.status)
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def log_rejected(request: Request, error: ApiError) -> None:
    """One line per refused request: method, path, status, the field and the reason (cut, escaped:
    it may quote the client's text); never a traceback. A client that left (499) is not refused."""
    if error.status != 499:
        log.info("%s %s refused %d, param %s: %s", request.method, request.url.path, error.status, error.param or "-",
                 json.dumps(error.message[:300]))
