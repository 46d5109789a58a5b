"""What a service instance's liveness keys hold (jaxstream.transport writes and reads them), and
how its stats show in the gateway's /stats.

- heartbeat (`Keys.heartbeat`): "<pid> <protocol version>", refreshed while the instance is ready,
  with a TTL. The pid lets `jaxstream up` forget a child that exited (transport.forget_processes);
  the version lets the gateway's /health name an instance that speaks another protocol. This
  text does not change with PROTOCOL_VERSION: it is how two versions tell each other apart.
- starting (`Keys.starting`): "<pid> <phase>" until the instance is ready (`Bus.phase`).
- stats (`Keys.stats`): one protocol.Stats as msgpack, written with the heartbeat, expiring with it.
"""

from __future__ import annotations

import msgspec


def heartbeat_value(pid: int, protocol: int) -> str:
    return f"{pid} {protocol}"


def read_heartbeat(value: str) -> tuple[int | None, int | None]:
    """(process id, protocol version) of a heartbeat; None for a part it does not hold (a service
    that carries no version speaks none this one knows)."""
    pid, _, protocol = value.partition(" ")
    return _number(pid), _number(protocol)


def starting_value(pid: int, phase: str) -> str:
    return f"{pid} {phase}"


def read_starting(value: str) -> tuple[int | None, str]:
    """(process id, phase) of a `starting` key's value."""
    pid, _, phase = value.partition(" ")
    return _number(pid), phase


def _number(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def as_json(stats: msgspec.Struct | None) -> dict[str, object]:
    """One instance's stats as /stats and /get_server_info show them: every field it reports, a
    nested Struct's (its facts) at the top level; {} while it has published none."""
    out: dict[str, object] = {}
    for name in () if stats is None else stats.__struct_fields__:
        value = getattr(stats, name)
        if isinstance(value, msgspec.Struct):
            out.update(as_json(value))
        elif value is not msgspec.UNSET:
            out[name] = msgspec.to_builtins(value)
    return out
