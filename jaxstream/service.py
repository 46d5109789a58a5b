"""Running one service process: config, logging, Redis bus, signals.

Every service's `__main__` is `run("role", main)`, where `main(cfg, bus)` loads what it needs
(saying what in `bus.phase`, which the gateway shows while the service starts, and logging one line
per phase with its time), calls `bus.start_heartbeat()` once ready, and loops until `bus.closing`. A scheduler's or a
worker's bus is named after its replica (`parallelism.replica`).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable

from jaxstream.config import AppConfig, ConfigError, load_config
from jaxstream.names import REPLICATED
from jaxstream.preflight import preflight
from jaxstream.transport import Bus

# A service's start, near enough for its "ready in N s": the modules above are imported by now;
# JAX is not (the worker imports it while starting, a phase of its own).
STARTED = time.monotonic()

log = logging.getLogger(__name__)

STOP_GRACE_S = 3.0
CONFIG_ERROR = 2  # the exit code of a service that refused its config: no restart mends that


def setup_logging(role: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s.%(msecs)03d {role} %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def die_with_parent() -> None:
    """Linux: get SIGTERM when the parent (`jaxstream up`) dies, even by SIGKILL: no orphans."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def parse_config(role: str, argv: list[str]) -> AppConfig:
    if {"-h", "--help"} & set(argv):
        print(usage(role))
        sys.exit(0)
    try:
        cfg = load_config(argv)
        preflight(cfg)  # what only the model's files show, before Redis or a model is touched
        return cfg
    except ConfigError as exc:
        print(f"{role}: config error: {exc}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)


def usage(role: str) -> str:
    from jaxstream.config import reference

    return (f"usage: python -m <{role} module> [overrides...]\n\nHydra overrides, e.g. model=smollm2 "
            f"redis.url=redis://127.0.0.1:6379 scheduler.page_size=32\n\n{reference()}")


def run(role: str, main: Callable[[AppConfig, Bus], Awaitable[None]], argv: list[str] | None = None) -> None:
    cfg = parse_config(role, sys.argv[1:] if argv is None else argv)
    replicated = role in REPLICATED and cfg.parallelism.data > 1
    setup_logging(f"{role}.{cfg.parallelism.replica}" if replicated else role)
    die_with_parent()
    try:
        asyncio.run(_serve(role, cfg, main))
    except ConfigError as exc:  # found while loading (a model path, say)
        print(f"{role}: config error: {exc}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)


async def _serve(role: str, cfg: AppConfig, main: Callable[[AppConfig, Bus], Awaitable[None]]) -> None:
    bus = Bus(cfg.redis, role, cfg.parallelism.replica if role in REPLICATED else None)
    bus.started = STARTED
    await bus.connect()
    bus.report_starting()
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    deadline: list[asyncio.TimerHandle] = []

    def stop() -> None:
        # Loops notice `closing` within one blocking read; cancel whatever is still running after that.
        if bus.own_signals:
            return  # e.g. uvicorn's in the gateway: asyncio's wakeup fd still brings the signal here too
        if not bus.closing:
            log.info("stopping")
            bus.closing = True
            deadline.append(loop.call_later(STOP_GRACE_S, task.cancel))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    try:
        await main(cfg, bus)
    except asyncio.CancelledError:
        pass
    finally:
        for handle in deadline:
            handle.cancel()
        await bus.close()
    log.info("stopped")
