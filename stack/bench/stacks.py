"""The servers a benchmark starts: `jaxstream up` with Hydra overrides on a free port (`--serve`),
or any server command (benchmarks/compare_cpu.py's llama.cpp), as child processes that never
outlive the benchmark.

- Each runs in a session of its own, so a terminal's Ctrl-C reaches the benchmark alone, which
  then stops them (its `finally`); and the kernel sends each SIGTERM if the benchmark dies without
  stopping them, even by SIGKILL (PR_SET_PDEATHSIG). `jaxstream up` passes both on: its services
  and its Redis die with it.
- They start together and are waited for together (their start-ups overlap), each until its ready
  URL answers 200 (`jaxstream up`'s /health: every service has a heartbeat). One that exits first,
  or is not ready in time, stops the benchmark with its command and its output's last lines. Their
  output goes to a temporary file, never to the terminal the table goes to.
- At the end, whatever ends the block: SIGTERM to each (`jaxstream up` drains its gateway and stops
  its services), then SIGKILL to what is left of each one's session.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from jaxstream.config import load_config
from jaxstream.redis_server import free_port
from jaxstream.service import die_with_parent
from stack.bench.served import BenchError, auth_headers, distinct

HOST = "127.0.0.1"
OWN_KEYS = ("server.host", "server.port")  # a --serve stack's, chosen by the benchmark
# `jaxstream up`'s own stop: the gateway's drain (server.drain_timeout_s, 30 by default), then the others.
STOP_TIMEOUT_S = 60.0
LAST_LINES = 20
GROUP_GONE_S = 5.0  # the longest wait for a killed session's last processes to go


class Server:
    """A server as a child process: `command`, ready once `ready_url` answers 200."""

    def __init__(self, name: str, command: list[str], url: str, ready_path: str = "/health") -> None:
        self.name, self.command, self.url = name, command, url
        self.ready_url = url + ready_path
        self.process: subprocess.Popen | None = None
        self.log = None

    def start(self) -> None:
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, preexec_fn=die_with_parent)

    def ready(self) -> bool:
        """Whether it answers; BenchError once it has exited."""
        if self.process.poll() is not None:
            raise BenchError(f"{self.name}: {shlex.join(self.command)} exited with code {self.process.returncode} "
                             f"before it was ready{self.last_lines()}")
        try:
            with urllib.request.urlopen(urllib.request.Request(self.ready_url, headers=auth_headers()), timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):  # nothing listens yet, a 503 while starting
            return False

    def last_lines(self) -> str:
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").splitlines()[-LAST_LINES:]
        return ("; its last lines:\n" + "\n".join(lines)) if lines else " (it wrote nothing)"

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def reap(self, deadline: float) -> None:
        """Wait for it until `deadline`, then kill what is left of its session (all it started there)."""
        if self.process is None:
            return
        try:
            self.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # its session's group: gone already, unless it left some behind
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        _wait_for_group_gone(self.process.pid, time.monotonic() + GROUP_GONE_S)
        self.log.close()


def _wait_for_group_gone(pgid: int, deadline: float) -> None:
    """SIGKILL is delivered when its target next runs: on a loaded machine what the session left
    (children of a process that died first, reparented) may still be there when killpg returns.
    Wait until none is left, or `deadline`."""
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.02)


@contextmanager
def running(servers: list[Server], timeout_s: float, say: Callable[[str], None]) -> Iterator[None]:
    """The block runs once every server is ready; they are stopped however it ends."""
    try:
        started = time.monotonic()
        for server in servers:
            say(f"starting {server.name} at {server.url}")
            server.start()
        waiting = list(servers)
        while True:
            for server in [s for s in waiting if s.ready()]:
                say(f"{server.name} ready after {time.monotonic() - started:.1f} s")
                waiting.remove(server)
            if not waiting:
                break
            if time.monotonic() - started > timeout_s:
                late = waiting[0]
                raise BenchError(f"{late.name}: {shlex.join(late.command)} was not ready within {timeout_s:g} s"
                                 f"{late.last_lines()}")
            time.sleep(0.2)
        yield
    finally:
        if any(s.process is not None for s in servers):
            say(f"stopping {', '.join(s.name for s in servers if s.process is not None)}")
        for server in servers:
            server.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for server in servers:
            server.reap(deadline)


def up_server(name: str, overrides: list[str]) -> Server:
    """`jaxstream up OVERRIDES` on 127.0.0.1 and a free port. The config is composed here first: a
    bad key is a ConfigError naming it before anything starts."""
    load_config(overrides)
    port = free_port()
    command = [sys.executable, "-m", "stack", "up", *overrides, f"server.host={HOST}", f"server.port={port}"]
    return Server(name, command, f"http://{HOST}:{port}")


def serve_names(serves: list[list[str]]) -> list[str]:
    """Each --serve stack's name: its overrides that not every stack has (what the comparison is
    about), else all of them, else `defaults`."""
    shared = set.intersection(*map(set, serves)) if len(serves) > 1 else set()
    return distinct([" ".join(o for o in own if o not in shared) or " ".join(own) or "defaults" for own in serves])


@contextmanager
def jaxstream_up(overrides: list[str], timeout_s: float = 900) -> Iterator[str]:
    """For the benchmark scripts: one stack, its base URL for the block. `timeout_s`: the JAX worker
    compiles its step shapes before /health answers."""
    server = up_server("jaxstream up", overrides)
    with running([server], timeout_s, lambda message: print(message, file=sys.stderr, flush=True)):
        yield server.url


def service_pid(base_url: str, module: str) -> int:
    """The pid of the `python -m <module>` service of the stack serving `base_url`: `jaxstream up`
    hands each of its services the stack's overrides, server.port among them."""
    port = f"server.port={urlsplit(base_url).port}"
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "-m" in cmdline[:-1] and cmdline[cmdline.index("-m") + 1] == module and port in cmdline:
            return int(proc.name)
    raise LookupError(f"no {module} serves {base_url}")
