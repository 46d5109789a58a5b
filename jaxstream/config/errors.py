"""The one error a bad configuration raises, and the check every schema's `__post_init__` uses."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key."""


def require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")
