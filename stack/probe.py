"""`python -m stack.probe [module overrides...]`: the health check of one service, as a container runs it.

Docker Compose runs it inside a service's container (docker-compose.yml's `healthcheck`). Without
arguments it finds the service there (the one `python -m <service module> overrides...` process in
/proc) and composes the config from that process's own overrides, so the check reads the same
Redis, namespace, port and replica as the service and cannot be configured apart from it. Given
arguments (`python -m stack.probe tokenizer_svc redis.url=...`), it checks that command instead.

- gateway: GET /health on its own port: 200 once every role has a live instance; a 503 names
  the missing ones, so the gateway's health is the stack's.
- any other role: a fresh heartbeat in Redis of its role (and, for a scheduler or worker, its
  replica). While it is starting, its start-up phase is the reason given. This is the role's
  health, not the container's own: every container of a scaled role runs the service under the
  same pid, so the heartbeat's value cannot tell them apart. A container whose service died is
  restarted by `restart: unless-stopped` whatever this says; a hung one among live peers of its
  role passes, and its peers reclaim its work once its heartbeat expires.

Exit 0 when healthy, else 1 with one line saying why (what `docker inspect` shows).
"""

from __future__ import annotations

import asyncio
import sys
import urllib.error
import urllib.request
from pathlib import Path

from jaxstream.config import AppConfig, ConfigError, load_config
from jaxstream.keys import load_keys
from jaxstream.names import REPLICATED
from jaxstream.transport import TRANSIENT, Bus
from stack.launcher import SERVICES

ROLES = {module: role for role, module in SERVICES.items()}


def service_command(proc: Path = Path("/proc")) -> list[str]:
    """[module, *overrides] of the one service process running here (inside its container)."""
    found = []
    for entry in proc.iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # not a process, or it ended meanwhile
            continue
        # The interpreter itself: with compose's `init: true`, pid 1 is docker-init, whose own argv
        # (`/sbin/docker-init -- python -m <service> ...`) carries the service's command too.
        if Path(argv[0]).name.startswith("python") and "-m" in argv[:-1] and argv[argv.index("-m") + 1] in ROLES:
            start = argv.index("-m") + 1
            found.append([a for a in argv[start:] if a])
    if len(found) != 1:
        raise LookupError(f"expected one service process here, found {len(found)}: pass its module and overrides")
    return found[0]


def check_gateway(cfg: AppConfig) -> str | None:
    """None when /health is 200, else why not."""
    key = load_keys(cfg.server).probe_key() if cfg.server.health_needs_key else None
    request = urllib.request.Request(f"http://127.0.0.1:{cfg.server.port}/health",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=5):
            return None
    except urllib.error.HTTPError as exc:
        return f"/health answered {exc.code}: {exc.read()[:300].decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as exc:
        return f"/health did not answer: {exc}"


async def check_heartbeat(cfg: AppConfig, role: str) -> str | None:
    """None when a live instance of `role` (of this replica, for a replicated role) heartbeats, else why not."""
    prefix = f"{role}.{cfg.parallelism.replica}." if role in REPLICATED else f"{role}."
    bus = Bus(cfg.redis, role)
    try:
        await bus.connect(attempts=1)  # a refused password is a ConfigError, in one line
        if any(name.startswith(prefix) for name in await bus.live_names()):
            return None
        phases = [phase for name, phase in (await bus.starting()).items() if name.startswith(prefix)]
        return f"{prefix.rstrip('.')} is starting ({phases[0] or 'connected'})" if phases else f"no heartbeat of {prefix.rstrip('.')}"
    except TRANSIENT as exc:
        return f"Redis unreachable: {exc}"
    finally:
        await bus.close()


def check(command: list[str]) -> str | None:
    module, overrides = command[0], command[1:]
    if module not in ROLES:
        raise ConfigError(f"{module}: not a service module (one of {', '.join(ROLES)})")
    cfg = load_config(overrides)
    role = ROLES[module]
    return check_gateway(cfg) if role == "gateway" else asyncio.run(check_heartbeat(cfg, role))


def main(argv: list[str]) -> int:
    try:
        problem = check(argv or service_command())
    except (LookupError, ConfigError) as exc:
        problem = str(exc)
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
