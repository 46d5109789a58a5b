"""Errors as OpenAI's nested error object, with the HTTP status.

`code` is what OpenAI's is: a string naming the problem where OpenAI has one ("model_not_found",
"context_length_exceeded", "invalid_type"), else null; never the HTTP status (that is the status line).

On SGLang's own routes (`SGLANG_PATHS`) the body also carries SGLang's flat ErrorResponse beside
that object, as SGLang's clients read it (sglang entrypoints/openai/protocol.py ErrorResponse, built
by serving_base.create_error_response and http_server's validation handler): `object: "error"`,
`message`, `type` (the status's phrase, "Bad Request"), `param` and `code` (the HTTP status, an
integer). The OpenAI `error` object stays, so clients of either dialect read their own keys."""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from starlette.requests import Request
from starlette.responses import JSONResponse

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               503: "service_unavailable", 500: "internal_server_error"}


# SGLang's own routes: their refusals carry SGLang's flat keys too (the module's story). A path
# here that the app does not serve fails tests/unit/test_openapi.py.
SGLANG_PATHS = frozenset({
    "/generate", "/v1/score", "/health_generate", "/abort_request", "/flush_cache", "/v1/loads", "/get_model_info", "/model_info",
    "/get_server_info", "/server_info", "/get_weight_version", "/weight_version", "/pause_generation", "/continue_generation",
    "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weight_version", "/release_memory_occupation",
    "/resume_memory_occupation", "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
    "/load_lora_adapter", "/unload_lora_adapter", "/load_lora_adapter_from_tensors",
})


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

    def sglang_body(self) -> dict:
        """The OpenAI object with SGLang's flat ErrorResponse beside it (the module's story)."""
        try:
            phrase = HTTPStatus(self.status).phrase
        except ValueError:  # 499: a client that left (nobody reads it)
            phrase = str(self.status)
        return {**self.body(), "object": "error", "message": self.message, "type": phrase, "param": self.param, "code": self.status}

    def response(self, path: str = "") -> JSONResponse:
        """The refusal as the route at `path` words its body (SGLang's routes: both shapes)."""
        # 401 is only ever a key refusal here (gateway/auth.py): say which scheme, as RFC 6750 asks; after a
        # 408 the rest of the body may still trickle in: the connection closes
        headers = {503: {"Retry-After": "1"}, 401: {"WWW-Authenticate": "Bearer"}, 408: {"Connection": "close"}}.get(self.status)
        body = self.sglang_body() if path in SGLANG_PATHS else self.body()
        return JSONResponse(body, status_code=self.status, headers=headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def log_rejected(request: Request, error: ApiError) -> None:
    """One line per refused request: method, path, status, the field and the reason (cut, escaped:
    it may quote the client's text); never a traceback. A client that left (499) is not refused."""
    if error.status != 499:
        log.info("%s %s refused %d, param %s: %s", request.method, request.url.path, error.status, error.param or "-",
                 json.dumps(error.message[:300]))
