"""Who may call which route: every route belongs to one class, and the keys configured
(jaxstream/keys.py) decide what opens each class.

- USER routes (every /v1 route, /generate, /tokenize, /detokenize, model info): the user key, or
  the admin key (it opens everything); open when no user key is set, even with an admin key
  (SGLang's rule: an admin key alone protects only the admin routes).
- ADMIN routes (what changes state or reveals configuration: aborts, flush, pause, weights,
  memory, server info): the admin key; without one, the user key, as SGLang's admin-optional
  routes take its api_key; open only when no key is set at all.
- PROBE routes (/health, /health_generate, /metrics, /stats, /openapi.json): open, so liveness
  probes, Prometheus and API clients reading the route list need no secret (SGLang and vLLM leave
  them open too); with server.health_needs_key, as USER routes.

A key comes as OpenAI's `Authorization: Bearer <key>` or as `x-api-key: <key>` (Anthropic's
header, which SGLang accepts too). A refusal is a 401 in OpenAI's error shape with
`WWW-Authenticate: Bearer`, before the body is read; it names neither the key expected nor the
one given.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import ApiError
from jaxstream.keys import Keys, matches

log = logging.getLogger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]


class Access(enum.Enum):
    PROBE = "probe"
    USER = "user"
    ADMIN = "admin"


def accepted(access: Access, keys: Keys) -> tuple[str, ...]:
    """The keys that open a route of this class; () when it is open to anyone."""
    if access is Access.PROBE and not keys.health_needs_key:
        return ()
    if access is Access.ADMIN:
        return (keys.admin,) if keys.admin else (keys.user,) if keys.user else ()
    return tuple(k for k in (keys.user, keys.admin) if k) if keys.user else ()


def presented(request: Request) -> list[str]:
    """Every key the request offers: a Bearer token (the scheme read case-blind, as RFC 6750
    allows) and an x-api-key header."""
    out = []
    scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        out.append(token.strip())
    if api_key := request.headers.get("x-api-key", "").strip():
        out.append(api_key)
    return out


def refusal(access: Access, keys: Keys, offered: list[str]) -> ApiError | None:
    """None when the offered keys open the route; else the 401 to answer."""
    wanted = accepted(access, keys)
    if not wanted:
        return None
    # every pair compared, none skipped: which one matched shows in no timing
    if any([matches(given, key) for given in offered for key in wanted]):
        return None
    which = "the admin API key" if access is Access.ADMIN and keys.admin else "an API key"
    if not offered:
        message = f"this route needs {which}: pass it as 'Authorization: Bearer <key>'"
    else:
        message = f"Incorrect API key provided: this route needs {which}"
    return ApiError(401, message, code="invalid_api_key")


def describe(keys: Keys) -> str:
    """Which keys guard what, for the start-up log line (never a key itself)."""
    if not keys.any:
        return "none set: every route is open (set $JAXSTREAM_API_KEY and $JAXSTREAM_ADMIN_API_KEY to guard them)"
    user = "the user key" if keys.user else "no key (no user key set)"
    admin = "the admin key" if keys.admin else "the user key (no admin key set)"
    probes = "the user key" if keys.health_needs_key and keys.user else "no key"
    return f"generation routes take {user}, admin routes {admin}, /health and /metrics {probes}"


class Guard:
    """Wraps each route's endpoint with its class's check; the wrapped endpoint carries `access`,
    so the route table itself says (and a test reads) which class every route is in."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys

    def user(self, endpoint: Endpoint) -> Endpoint:
        return self._guard(Access.USER, endpoint)

    def admin(self, endpoint: Endpoint) -> Endpoint:
        return self._guard(Access.ADMIN, endpoint)

    def probe(self, endpoint: Endpoint) -> Endpoint:
        return self._guard(Access.PROBE, endpoint)

    def _guard(self, access: Access, endpoint: Endpoint) -> Endpoint:
        keys = self.keys

        @functools.wraps(endpoint)
        async def guarded(request: Request) -> Response:
            if (refused := refusal(access, keys, presented(request))) is not None:
                client = request.client.host if request.client else "?"
                log.warning("401 %s %s from %s: %s", request.method, request.url.path, client,
                            "wrong key" if presented(request) else "no key")
                return refused.response()
            return await endpoint(request)

        guarded.access = access
        return guarded
