"""Errors as OpenAI's nested error object, with the HTTP status.

`code` is what OpenAI's is: a string naming the problem where OpenAI has one ("model_not_found",
"context_length_exceeded", "invalid_type"), else null; never the HTTP status (that is the status line)."""

from __future__ import annotations

from starlette.responses import JSONResponse

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
        # 401 is only ever a key refusal here (gateway/auth.py): say which scheme, as RFC 6750 asks
        headers = {"Retry-After": "1"} if self.status == 503 else {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)
