"""`jaxstream up`: the whole stack as child processes of one foreground supervisor.

1. Validate the config (a bad key fails here, before anything starts, and so does what only the
   model's files show: jaxstream/preflight.py), and that the gateway's host:port is free (a busy
   port is one line and exit 2, not a JAX start-up for nothing).
2. Use `redis.url`, or start an embedded redis-server on a free port (chosen while the gateway's
   port is held, so never that one), with a random password.
3. Start the five services with the same overrides (plus the Redis URL) and this environment, less
   what a service has no use for (`child_env`): the API keys go to the gateway alone, the Redis
   password to every service (never in arguments, which `ps` shows); prefix their logs. The scheduler and the worker run once per data-parallel replica
   (`parallelism.data`), each told its `parallelism.replica` and logging as `scheduler.1`; every
   other service runs once.
4. Say when each role is up (as /health sees it), then, once /health answers 200 (every service
   has a heartbeat), print the URL. A start that does not finish says so: every
   supervisor.start_report_s until the stack is ready, which roles are not up, each with its last
   start-up phase (or "not running"), as /health names them.
5. Heal (supervisor.restart=always, the default): a child that dies is seen at once (not a heartbeat
   TTL later): its heartbeat is deleted, so the gateway fails the requests it held (an SSE error
   event and [DONE], or a 503) and the others take over its entries; then its unit starts again
   after a back-off (supervisor.py: a replica's scheduler and worker together, the partner stopped
   first; the embedded Redis on its port, the services reconnecting). A crash loop stops the stack,
   naming the service with its last log lines. `--restart=never` (supervisor.restart=never): a
   child's death stops the stack (exit 1).
   A child that lives but is stalled (jaxstream/transport/liveness.py: a scheduler with steps in
   flight and no result for server.scheduler_stall_s, a scheduler or detokenizer leaving its
   streams' entries unhandled that long) is treated as dead: stopped, its requests failed, its
   unit restarted. A wedge becomes a restart, never a silent hang.
6. On Ctrl-C / SIGTERM stop them all and exit 0: the gateway first, which drains (its requests in
   flight finish, server.drain_timeout_s at most), then the others, then the embedded Redis.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
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
from collections import deque

from jaxstream.config import AppConfig, load_config
from jaxstream.keys import ADMIN_API_KEY_ENV, API_KEY_ENV, REDIS_PASSWORD_ENV, Keys, load_keys
from jaxstream.listen import listen
from jaxstream.names import REPLICATED, role_of
from jaxstream.preflight import preflight
from jaxstream.redis_server import EmbeddedRedis
from jaxstream.service import CONFIG_ERROR
from jaxstream.transport import TRANSIENT, forget_processes, stalled_processes
from stack.supervisor import REDIS, CrashLoop, Restarts, unit_of

SERVICES = {  # role -> module
    "gateway": "gateway",
    "tokenizer": "tokenizer_svc",
    "scheduler": "scheduler_svc",
    "worker": "worker_svc",
    "detokenizer": "detokenizer_svc",
}
STOP_TIMEOUT_S = 10.0
LAST_LINES = 20  # of a child's log, shown when it is in a crash loop
REPLICA_KEY = "parallelism.replica"
RESTART_FLAG = "--restart="


def say(message: str) -> None:
    print(f"jaxstream: {message}", file=sys.stderr, flush=True)


class Stack:
    def __init__(self, cfg: AppConfig, overrides: list[str], keys: Keys = Keys()) -> None:
        self.cfg = cfg
        self.overrides = overrides
        self.keys = keys  # to ask /health when it wants a key (server.health_needs_key)
        self.redis: EmbeddedRedis | None = None
        self.commands: dict[str, list[str]] = {}  # by child name: how to start it (again)
        self.children: dict[str, subprocess.Popen] = {}  # by name: the role, or `scheduler.1` for a replica's
        self.logs: dict[str, deque[str]] = {}  # each child's last lines, for a crash loop's message
        self.relays: dict[str, threading.Thread] = {}  # each child's log relay, done at its output's end
        self.restarts = Restarts(cfg.supervisor.max_restarts, cfg.supervisor.restart_window_s)
        self.due: dict[str, float] = {}  # unit -> when it starts again (its members are down meanwhile)
        self.stopping = threading.Event()
        self.started = time.monotonic()
        self.up: set[str] = set()  # the children /health has seen up
        self.spawned: dict[str, float] = {}  # by child name: when it last started
        self.restarted: set[str] = set()  # the children started again at least once
        self.ready = False
        self.healing_since: float | None = None  # the first death since the stack was last healthy
        self.next_report = self.started + cfg.supervisor.start_report_s  # when to say who is not up yet
        self.next_liveness = 0.0  # when to look for stalled children next

    @property
    def url(self) -> str:
        return f"http://{self.cfg.server.host}:{self.cfg.server.port}"

    def choose_redis(self) -> None:
        """Without redis.url, an embedded Redis on a free port (started by `start`). The caller holds
        the gateway's port meanwhile: else the kernel may hand Redis that port (free until the
        gateway binds it), and /health would ask Redis."""
        if not self.cfg.redis.url:
            self.redis = EmbeddedRedis(password=secrets.token_hex(16))

    def start(self) -> None:
        overrides = list(self.overrides)
        if self.redis is not None:
            self.redis.start()
            overrides.append(f"redis.url={self.redis.url}")
            os.environ[REDIS_PASSWORD_ENV] = self.redis.password  # the children's, and this process's own client
            say(f"embedded redis-server at {self.redis.url}, with a random password")
        self.redis_cfg = dataclasses.replace(self.cfg.redis, url=self.cfg.redis.url or self.redis.url)
        for name, module, extra in self.processes():
            self.commands[name] = [sys.executable, "-u", "-m", module, *overrides, *extra]
            self.spawn(name)

    def spawn(self, name: str) -> None:
        # Each child gets this environment (its secrets there, never in argv), less what it has no use for.
        child = subprocess.Popen(self.commands[name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=child_env(name))
        self.logs[name] = deque(maxlen=LAST_LINES)
        self.spawned[name] = time.monotonic()
        self.relays[name] = threading.Thread(target=self._relay, args=(name, child), daemon=True)
        self.relays[name].start()
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
        lines = self.logs[name]
        for line in iter(child.stdout.readline, b""):
            text = line.decode(errors="replace")
            lines.append(text)
            sys.stdout.write(prefix + text)
            sys.stdout.flush()

    def missing(self) -> list[str] | None:
        """What /health names as not up yet ([] once healthy); None while the gateway does not answer."""
        body = self.health()
        return None if body is None else list(body.get("missing", []))

    def health(self) -> dict | None:
        """/health's answer: {} once healthy, else its 503 body (missing, starting, stalled roles);
        None while the gateway does not answer."""
        key = self.keys.probe_key() if self.keys.health_needs_key else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + "/health", headers=headers), timeout=2):
                return {}
        except urllib.error.HTTPError as exc:  # 503: starting or unhealthy, naming who is missing
            if exc.code != 503:
                return None  # not a gateway's health answer (a 401 would be a key the gateway refused)
            try:
                body = json.loads(exc.read())
            except ValueError:
                return None
            return body if isinstance(body, dict) else None
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            return None  # nothing listens yet, or something that does not speak HTTP

    def report_not_up(self, now: float, body: dict | None) -> None:
        """Every supervisor.start_report_s until ready: which roles are not up, with their last phase."""
        if now < self.next_report:
            return
        self.next_report = now + self.cfg.supervisor.start_report_s
        since = f"{now - self.started:.0f} s after start" if self.healing_since is None else \
            f"{now - self.healing_since:.0f} s after the first death"
        say(f"not ready {since}: {not_up(body)}")

    def say_who_is_up(self, missing: list[str]) -> None:
        for name in self.children:
            if name not in self.up and name not in missing and not self.down(name):
                self.up.add(name)
                if name in self.restarted:
                    say(f"{name} up again, {time.monotonic() - self.spawned[name]:.1f} s after its restart")
                else:
                    say(f"{name} up after {time.monotonic() - self.started:.1f} s")

    def last_lines(self, name: str) -> str:
        """A dead child's last lines, once its relay has read them all."""
        self.relays[name].join(2)
        return "".join(self.logs.get(name, ())).rstrip()

    def down(self, name: str) -> bool:
        return unit_of(name) in self.due

    def wait(self) -> int:
        """Block until a signal (exit 0), or until a child's death (restart=never) or a crash loop
        (exit 1); heal meanwhile."""
        while not self.stopping.is_set():
            try:
                self.supervise(time.monotonic())
            except CrashLoop as exc:
                say(f"{exc}: a crash loop; stopping the stack")
                return 1
            except Died as exc:
                say(f"{exc}; stopping the stack")
                return 1
            if not self.ready:
                self.look_at_health(time.monotonic())
            self.stopping.wait(0.2)
        return 0

    def look_at_health(self, now: float) -> None:
        """Until /health answers 200: say who came up, and now and then who has not."""
        body = self.health()
        self.report_not_up(now, body)
        if body is None:
            return
        self.say_who_is_up(list(body.get("missing", [])))
        if not body and not self.due:
            self.ready = True
            if self.healing_since is None:
                say(f"ready: serving {self.cfg.model.name} at {self.url} (OpenAI base URL {self.url}/v1), "
                    f"{time.monotonic() - self.started:.1f} s after start")
            else:
                say(f"healthy again, {time.monotonic() - self.healing_since:.1f} s after the first death")
                self.healing_since = None

    def supervise(self, now: float) -> None:
        """Notice deaths and stalls (restart the units that are due)."""
        for name, code in self.dead():
            if self.cfg.supervisor.restart == "never":
                raise Died(f"{name} exited with code {code}")
            if code == CONFIG_ERROR and name != REDIS:  # it said why, in its last lines
                lines = self.last_lines(name)
                raise Died(f"{name} refused its config{': ' + lines.splitlines()[-1] if lines else ''} (no restart mends that)")
            self.bring_down(unit_of(name), f"{name} exited with code {code}", now)
        for name, why in self.stalled(now).items():
            if self.cfg.supervisor.restart == "never":
                raise Died(f"{name} is stalled ({why})")
            if not self.down(name):  # another of its unit's may have brought it down already
                self.bring_down(unit_of(name), f"{name} is stalled ({why})", now)
        for unit, when in list(self.due.items()):
            if when <= now:
                del self.due[unit]
                self.bring_up(unit)

    def dead(self) -> list[tuple[str, int]]:
        """(name, exit code) of each child, and of the embedded Redis (`redis`), that died and is not
        down for a restart already; none while the stack stops."""
        if self.stopping.is_set():
            return []
        processes = dict(self.children) | ({REDIS: self.redis.process} if self.redis else {})
        return [(name, p.returncode) for name, p in processes.items() if not self.down(name) and p.poll() is not None]

    def stalled(self, now: float) -> dict[str, str]:
        """Child name -> why, for each child alive but stalled (looked up once a heartbeat)."""
        if now < self.next_liveness or self.stopping.is_set() or REDIS in self.due:
            return {}
        self.next_liveness = now + self.cfg.redis.heartbeat_ms / 1000
        try:
            found = asyncio.run(stalled_processes(self.redis_cfg, self.cfg.parallelism.data, self.cfg.server.stall_limits()))
        except TRANSIENT:
            return {}  # Redis down: its restart is the supervisor's business already
        by_pid = {child.pid: name for name, child in self.children.items() if child.poll() is None}
        return {by_pid[pid]: why for pid, why in found.items() if pid in by_pid}

    def bring_down(self, unit: str, why: str, now: float) -> None:
        """After a death in `unit`: stop the rest of it, tell the others at once, schedule its restart."""
        members = [n for n in self.children if unit_of(n) == unit]
        dead = [n for n in members if self.children[n].poll() is not None]
        self.forget(dead)  # first: the gateway fails the requests while the partner stops
        for name in members:
            self.stop_child(name, self.children[name], STOP_TIMEOUT_S)
            self.up.discard(name)
        self.forget([n for n in members if n not in dead])
        if self.ready:
            self.next_report = now + self.cfg.supervisor.start_report_s
        self.ready = False
        self.healing_since = self.healing_since or now
        try:
            delay = self.restarts.died(unit, now)
        except CrashLoop:
            for name in members:
                lines = self.last_lines(name)
                say(f"{name}'s last lines:\n{lines}" if lines else f"{name} wrote nothing")
            raise
        say(f"{why}; restarting {unit} in {delay:g} s")
        self.due[unit] = now + delay

    def forget(self, names: list[str]) -> None:
        """Delete the dead children's heartbeats: the gateway fails their requests now, not a TTL later."""
        pids = {self.children[n].pid for n in names}
        if not pids:
            return
        try:
            asyncio.run(forget_processes(self.redis_cfg, pids))
        except TRANSIENT:
            pass  # Redis is down too: its restart ends every request anyway

    def bring_up(self, unit: str) -> None:
        if unit == REDIS:
            self.redis.start()
            return
        for name in self.commands:
            if unit_of(name) == unit:
                self.restarted.add(name)
                self.spawn(name)

    def stop_child(self, name: str, child: subprocess.Popen, timeout_s: float) -> None:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            say(f"{name} did not stop within {timeout_s:g} s; killing it")
            child.kill()
            child.wait()

    def stop(self) -> None:
        """The gateway first (it drains: its requests in flight finish), then the others at once."""
        self.due.clear()
        gateway = self.children.get("gateway")
        if gateway is not None:
            self.stop_child("gateway", gateway, self.cfg.server.drain_timeout_s + STOP_TIMEOUT_S)
        for child in self.children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for name, child in self.children.items():
            self.stop_child(name, child, max(0.1, deadline - time.monotonic()))
        if self.redis:
            self.redis.stop()


def not_up(body: dict | None) -> str:
    """What a /health answer says is not up: each missing role with its last phase, or "not
    running"; the stalled and mismatched ones."""
    if body is None:
        return "the gateway does not answer /health yet"
    phases = body.get("starting", {})
    parts = [f"{m} ({'starting' + (': ' + phases[m] if phases[m] else '') if m in phases else 'not running'})"
             for m in body.get("missing", [])]
    parts += [f"{name} (stalled: {why})" for name, why in body.get("stalled", {}).items()]
    parts += [f"{mismatch}" for mismatch in body.get("mismatched", [])]
    return ", ".join(parts) or str(body)


def child_env(name: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of child `name` (`worker.1`: its role, then the replica): this one's, without the
    API keys unless it is the gateway, which alone checks them. A key in a service that never reads
    it would only be one more place to leak it from (/proc/<pid>/environ, a core dump, a crash
    report). The Redis password every service needs."""
    environ = dict(os.environ if environ is None else environ)
    if role_of(name) != "gateway":
        for secret in (API_KEY_ENV, ADMIN_API_KEY_ENV):
            environ.pop(secret, None)
    return environ


class Died(Exception):
    """A child exited and supervisor.restart is never, or it refused its config."""


def up(args: list[str]) -> int:
    # `--restart=never` is the override supervisor.restart=never, spelt as docker's flag
    overrides = [f"supervisor.restart={a.removeprefix(RESTART_FLAG)}" if a.startswith(RESTART_FLAG) else a for a in args]
    cfg = load_config(overrides)  # ConfigError is reported by the caller
    preflight(cfg)  # what only the model's files show (a path, a tensor degree), before anything starts
    if any(o.startswith(REPLICA_KEY + "=") for o in overrides):
        say(f"{REPLICA_KEY} is set for each scheduler and worker by `jaxstream up`; ignoring the one given")
        overrides = [o for o in overrides if not o.startswith(REPLICA_KEY + "=")]
    keys = load_keys(cfg.server)  # an unreadable key file fails here, in one line, as the gateway would
    stack = Stack(cfg, overrides, keys)
    with listen(cfg.server.host, cfg.server.port):  # ConfigError when busy, before anything heavy starts
        stack.choose_redis()

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
