"""`jaxstream up`: the whole stack as child processes of one foreground supervisor.

1. Validate the config (a bad key fails here, before anything starts), and that the gateway's
   host:port is free (a busy port is one line and exit 2, not a JAX start-up for nothing).
2. Use `redis.url`, or start an embedded redis-server on a free port, with a random password.
3. Start the five services with the same overrides (plus the Redis URL) and this environment (the
   gateway's API keys come from it, and the embedded Redis's password: never from arguments, which
   `ps` shows); prefix their logs. The
   scheduler and the worker run once per data-parallel replica (`parallelism.data`), each told its
   `parallelism.replica` and logging as `scheduler.1`; every other service runs once.
4. Say when each role is up (as /health sees it), then, once /health answers 200 (every service
   has a heartbeat), print the URL.
5. On Ctrl-C / SIGTERM stop them all and exit 0; if a child dies, say which and exit 1.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from jaxstream.config import AppConfig, load_config
from jaxstream.keys import REDIS_PASSWORD_ENV, Keys, load_keys
from jaxstream.listen import listen
from jaxstream.redis_server import EmbeddedRedis
from jaxstream.transport import REPLICATED

SERVICES = {  # role -> module
    "gateway": "gateway",
    "tokenizer": "tokenizer_svc",
    "scheduler": "scheduler_svc",
    "worker": "worker_svc",
    "detokenizer": "detokenizer_svc",
}
STOP_TIMEOUT_S = 10.0
REPLICA_KEY = "parallelism.replica"


def say(message: str) -> None:
    print(f"jaxstream: {message}", file=sys.stderr, flush=True)


class Stack:
    def __init__(self, cfg: AppConfig, overrides: list[str], keys: Keys = Keys()) -> None:
        self.cfg = cfg
        self.overrides = overrides
        self.keys = keys  # to ask /health when it wants a key (server.health_needs_key)
        self.redis: EmbeddedRedis | None = None
        self.children: dict[str, subprocess.Popen] = {}  # by name: the role, or `scheduler.1` for a replica's
        self.stopping = threading.Event()
        self.started = time.monotonic()
        self.up: set[str] = set()  # the children /health has seen up

    @property
    def url(self) -> str:
        return f"http://{self.cfg.server.host}:{self.cfg.server.port}"

    def start(self) -> None:
        overrides = list(self.overrides)
        env = dict(os.environ)  # the gateway reads its keys here, never in argv
        if not self.cfg.redis.url:
            self.redis = EmbeddedRedis(password=secrets.token_hex(16)).start()
            overrides.append(f"redis.url={self.redis.url}")
            env[REDIS_PASSWORD_ENV] = self.redis.password
            say(f"embedded redis-server at {self.redis.url}, with a random password")
        for name, module, extra in self.processes():
            child = subprocess.Popen([sys.executable, "-u", "-m", module, *overrides, *extra], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            threading.Thread(target=self._relay, args=(name, child), daemon=True).start()
            self.children[name] = child

    def processes(self) -> list[tuple[str, str, list[str]]]:
        """(name, module, overrides of its own) of every child: a scheduler and a worker per replica."""
        data = self.cfg.parallelism.data
        out = []
        for role, module in SERVICES.items():
            if role not in REPLICATED:
                out.append((role, module, []))
            else:
                out += [(f"{role}.{r}" if data > 1 else role, module, [f"{REPLICA_KEY}={r}"]) for r in range(data)]
        return out

    def _relay(self, name: str, child: subprocess.Popen) -> None:
        prefix = f"[{name}] ".ljust(16)
        for line in iter(child.stdout.readline, b""):
            sys.stdout.write(prefix + line.decode(errors="replace"))
            sys.stdout.flush()

    def dead_child(self) -> tuple[str, int] | None:
        for role, child in self.children.items():
            if child.poll() is not None:
                return role, child.returncode
        return None

    def missing(self) -> list[str] | None:
        """What /health names as not up yet ([] once healthy); None while the gateway does not answer."""
        key = self.keys.probe_key() if self.keys.health_needs_key else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + "/health", headers=headers), timeout=2):
                return []
        except urllib.error.HTTPError as exc:  # 503: starting or unhealthy, naming who is missing
            if exc.code != 503:
                return None  # not a gateway's health answer (a 401 would be a key the gateway refused)
            try:
                return list(json.loads(exc.read()).get("missing", []))
            except ValueError:
                return None
        except (urllib.error.URLError, OSError):
            return None

    def say_who_is_up(self, missing: list[str]) -> None:
        for name in self.children:
            if name not in self.up and name not in missing:
                self.up.add(name)
                say(f"{name} up after {time.monotonic() - self.started:.1f} s")

    def wait(self) -> int:
        """Block until a signal (exit 0) or a child's death (exit 1)."""
        ready = False
        while not self.stopping.is_set():
            dead = self.dead_child()
            if dead:
                say(f"{dead[0]} exited with code {dead[1]}; stopping the stack")
                return 1
            if not ready and (missing := self.missing()) is not None:
                self.say_who_is_up(missing)
                if not missing:
                    ready = True
                    say(f"ready: serving {self.cfg.model.name} at {self.url} (OpenAI base URL {self.url}/v1), "
                        f"{time.monotonic() - self.started:.1f} s after start")
            self.stopping.wait(0.2)
        return 0

    def stop(self) -> None:
        for child in self.children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for role, child in self.children.items():
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"{role} did not stop within {STOP_TIMEOUT_S} s; killing it")
                child.kill()
                child.wait()
        if self.redis:
            self.redis.stop()


def up(overrides: list[str]) -> int:
    cfg = load_config(overrides)  # ConfigError is reported by the caller
    if any(o.startswith(REPLICA_KEY + "=") for o in overrides):
        say(f"{REPLICA_KEY} is set for each scheduler and worker by `jaxstream up`; ignoring the one given")
        overrides = [o for o in overrides if not o.startswith(REPLICA_KEY + "=")]
    keys = load_keys(cfg.server)  # an unreadable key file fails here, in one line, as the gateway would
    listen(cfg.server.host, cfg.server.port).close()  # ConfigError when busy, before anything heavy starts
    stack = Stack(cfg, overrides, keys)

    def on_signal(signum, frame) -> None:
        stack.stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        stack.start()
        code = stack.wait()
    finally:
        stack.stop()
    say("stopped")
    return code
