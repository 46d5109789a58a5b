"""Counts and lists in messages read as English: "1 token", "2 tokens", "5, 7 and 9"."""

from __future__ import annotations

from collections.abc import Iterable


def counted(n: int, noun: str, plural: str | None = None) -> str:
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def listed(items: Iterable[object], limit: int = 10) -> str:
    """Every item, "a, b and c"; past `limit` of them the first ones and a count of the rest, so a
    message stays one short line whatever a client sent."""
    words = [str(i) for i in items]
    if len(words) > limit:
        return f"{', '.join(words[:limit])} and {len(words) - limit} more"
    return " and ".join(words) if len(words) <= 2 else f"{', '.join(words[:-1])} and {words[-1]}"
