"""`--stats`: chosen fields of each target's /stats after the run, side by side.

jaxstream's /stats is {role: {instance: {key: value}}}; a field is named ROLE.KEY, its KEY a shell
pattern (`worker.idle_gap_ms_*`). A field has a value per instance of its role (one under `jaxstream
up`, one per replica for a scheduler or a worker with parallelism.data > 1), in instance-name order.
The in-process engine has the worker's only; a server without /stats has none. A scheduler's are
current (the gateway has it write them before it answers); the others' come with their heartbeat,
so they may miss the last moments of the run.
"""

from __future__ import annotations

import json
from fnmatch import fnmatchcase

from stack.launcher import SERVICES

ROLES = tuple(SERVICES)


def pattern_error(field: str) -> str | None:
    """Why `field` is not ROLE.KEY, or None."""
    role, dot, key = field.partition(".")
    if not dot or not key or role not in ROLES:
        return f"{field!r} is not ROLE.KEY (ROLE one of {', '.join(ROLES)}; KEY may hold * and ?)"
    return None


def fields(stats: dict[str, dict], patterns: list[str]) -> list[str]:
    """The ROLE.KEY fields the patterns match in any target's stats (`stats`: by target), in pattern
    order, sorted within one; a pattern that matches nothing stands for itself (its values: none)."""
    out: list[str] = []
    for pattern in patterns:
        role, _, key = pattern.partition(".")
        keys = {k for s in stats.values() for instance in (s.get(role) or {}).values() for k in instance}
        found = [f"{role}.{k}" for k in sorted(keys) if fnmatchcase(k, key)] or [pattern]
        out += [f for f in found if f not in out]
    return out


def values(stats: dict, field: str) -> list:
    """One target's values of `field`, one per instance that has it, in instance-name order."""
    role, _, key = field.partition(".")
    instances = stats.get(role) or {}
    return [instances[name][key] for name in sorted(instances) if key in instances[name]]


def selected(stats: dict[str, dict], patterns: list[str]) -> dict[str, dict[str, list]]:
    """{target: {field: values}}, for the JSON and the table."""
    names = fields(stats, patterns)
    return {target: {f: values(s, f) for f in names} for target, s in stats.items()}


def table(chosen: dict[str, dict[str, list]]) -> str:
    """A row per field, a column per target; several instances' values joined by ' / '."""
    targets = list(chosen)
    names = list(next(iter(chosen.values()), {}))
    first = max([len(n) for n in names] + [len("/stats")])
    widths = [max(len(t), 8) for t in targets]
    lines = [f"{'/stats':<{first}}" + "".join(f" {t:>{w}}" for t, w in zip(targets, widths))]
    for name in names:
        cells = (" / ".join(_text(v) for v in chosen[t][name]) or "-" for t in targets)
        lines.append(f"{name:<{first}}" + "".join(f" {c:>{w}}" for c, w in zip(cells, widths)))
    return "\n".join(lines)


def _text(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return value if isinstance(value, str) else json.dumps(value)
