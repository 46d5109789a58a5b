"""The server's secrets: where its API keys come from, and how secrets stay out of what it shows.

A key never comes from a config value: `jaxstream up` hands every child its overrides as
arguments, which `ps` shows to every user of the machine. It comes from the environment (which
`jaxstream up` passes on to the gateway, and which only the process's own user can read) or from
a file named by config (a path is no secret). So does the Redis password (REDIS_PASSWORD_ENV), unless an
operator writes it into redis.url themselves. What the server shows of its config (/get_server_info,
`jaxstream config`, log lines) goes through `public_config`, which masks the Redis password.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from jaxstream.config import AppConfig, ConfigError, ServerConfig

API_KEY_ENV = "JAXSTREAM_API_KEY"
ADMIN_API_KEY_ENV = "JAXSTREAM_ADMIN_API_KEY"
# The Redis password, when redis.url names none: every service reads it here (compose sets it, `jaxstream
# up` sets a random one for its embedded Redis), so no URL in any process's arguments carries it.
REDIS_PASSWORD_ENV = "JAXSTREAM_REDIS_PASSWORD"
MASK = "***"


@dataclass(frozen=True)
class Keys:
    """The gateway's keys; None where none is configured. repr() masks them, so a key logged or
    printed by accident (an exception's locals, a debug line) shows as *** instead."""

    user: str | None = None
    admin: str | None = None
    health_needs_key: bool = False

    def __repr__(self) -> str:
        def shown(key: str | None) -> str:
            return "None" if key is None else repr(MASK)
        return f"Keys(user={shown(self.user)}, admin={shown(self.admin)}, health_needs_key={self.health_needs_key})"

    @property
    def any(self) -> bool:
        return bool(self.user or self.admin)

    def probe_key(self) -> str | None:
        """What `jaxstream up` presents to /health: any key that opens a user route."""
        return self.user or self.admin


def load_keys(server: ServerConfig, environ: Mapping[str, str] = os.environ) -> Keys:
    """The user and admin keys, each from its environment variable or from its file (not both:
    which one wins would be a guess). An empty variable counts as unset, as vLLM's VLLM_API_KEY."""
    return Keys(user=_key(environ, API_KEY_ENV, server.api_key_file, "server.api_key_file"),
                admin=_key(environ, ADMIN_API_KEY_ENV, server.admin_api_key_file, "server.admin_api_key_file"),
                health_needs_key=server.health_needs_key)


def _key(environ: Mapping[str, str], variable: str, path: str | None, config_key: str) -> str | None:
    from_env = environ.get(variable, "").strip() or None
    if path is None:
        return from_env
    if from_env is not None:
        raise ConfigError(f"{config_key}: the key is given both there and in ${variable}; keep one")
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config_key}: cannot read {path}: {exc.__class__.__name__}: {getattr(exc, 'strerror', None) or exc}") from None
    lines = text.splitlines()
    key = lines[0].strip() if lines else ""  # the first line: a trailing newline is no part of it
    if not key:
        raise ConfigError(f"{config_key}: {path} is empty (the key is its first line)")
    return key


def matches(presented: str, key: str) -> bool:
    """Constant-time: both sides are hashed first, so neither the time nor an early length check
    tells how much of a guess was right (vLLM's way). A header arrives as latin-1 text; its bytes
    are what the client sent."""
    given = hashlib.sha256(presented.encode("latin-1", errors="replace")).digest()
    return hmac.compare_digest(given, hashlib.sha256(key.encode("utf-8")).digest())


def redact_url(url: str | None) -> str | None:
    """A URL with its password (in the user part, or redis-py's `?password=`) replaced by ***."""
    if not url:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        user = parts.username or ""
        netloc = f"{user}:{MASK}@{netloc.rpartition('@')[2]}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(name == "password" for name, _ in pairs):
            query = urlencode([(name, MASK if name == "password" else value) for name, value in pairs], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def public_config(cfg: AppConfig) -> dict[str, Any]:
    """The config as a dict, fit to show: the Redis URL's password masked. Keys never are in it
    (only the paths of their files)."""
    shown = dataclasses.asdict(cfg)
    shown["redis"]["url"] = redact_url(cfg.redis.url)
    return shown
