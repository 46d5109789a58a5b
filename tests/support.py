"""Helpers for tests that run the real services as processes on a real Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from jaxstream.redis_server import free_port
from stack.bench.stacks import service_pid  # noqa: F401 (the tests' way to find a stack's service)

ROOT = Path(__file__).resolve().parent.parent


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.1) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def healthy(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def scheduler_stats(base_url: str) -> list[dict[str, int]]:
    return list(httpx.get(base_url + "/stats", timeout=5).json()["scheduler"].values())


def running(base_url: str) -> int:
    return sum(s["running"] for s in scheduler_stats(base_url))


def is_idle(base_url: str) -> bool:
    """The DESIGN invariant: once idle, nothing runs or waits and every page is free or held by the
    prefix cache, where no request pins it."""
    stats = scheduler_stats(base_url)
    return bool(stats) and all(s["running"] == 0 and s["waiting"] == 0
                               and s["pages_used"] == s.get("pages_cached", 0) == s.get("pages_evictable", 0) for s in stats)


def assert_idle(base_url: str, timeout: float = 10.0) -> None:
    try:
        wait_for(lambda: is_idle(base_url), timeout, "the scheduler to be idle with every page free or cached", interval=0.2)
    except AssertionError:
        raise AssertionError(f"not idle: {scheduler_stats(base_url)}") from None


# Where Process logs go: tests/conftest.py points it into pytest's temporary directory, removed after a
# session that passed and kept after one that failed; None (the system's temporary directory) outside pytest.
LOG_DIR: Path | None = None


class Process:
    """A child process whose output goes to a temporary log file (in LOG_DIR)."""

    def __init__(self, args: list[str], name: str, own_group: bool = False, cwd: Path = ROOT,
                 env: dict[str, str] | None = None) -> None:
        """`own_group`: in a process group of its own, as a shell's foreground job is (see `interrupt`)."""
        self.name = name
        self.log_path = Path(tempfile.mkstemp(prefix=f"jaxstream-{name}-", suffix=".log", dir=LOG_DIR)[1])
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=own_group)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def interrupt(self) -> None:
        """What Ctrl-C in a terminal does: SIGINT to every process of the foreground group (its
        children included, unless they left it). Needs `own_group`."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def stop(self, timeout: float = 15.0) -> int:
        self.signal(signal.SIGTERM)
        return self.wait(timeout)

    def wait(self, timeout: float = 15.0) -> int:
        """Its exit code once it exits (killed after `timeout` s: an AssertionError with its log)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.name} did not stop within {timeout} s:\n{self.log()[-3000:]}") from None
        finally:
            self._log.close()


def stack_overrides(redis_url: str, port: int, *extra: str) -> list[str]:
    """Each stack gets its own Redis namespace, so stacks and tests share one server safely."""
    return [f"redis.url={redis_url}", f"redis.namespace=test-{uuid.uuid4().hex[:8]}", f"server.port={port}", *extra]


def start_up(redis_url: str | None, *extra: str, port: int | None = None, own_group: bool = False,
             command: tuple[str, ...] = (sys.executable, "-m", "stack"), cwd: Path = ROOT,
             env: dict[str, str] | None = None) -> tuple[Process, str]:
    """`jaxstream up` as a user runs it; returns it once it printed that it is ready (/health is 200).
    `command`: the `jaxstream` command to run (by default this checkout's), from `cwd`."""
    port = port or free_port()
    overrides = stack_overrides(redis_url, port, *extra) if redis_url else [f"server.port={port}", *extra]
    up = Process([*command, "up", *overrides], "up", own_group, cwd, env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        # The JAX worker compiles every step shape before the stack is ready: minutes on a cold cache.
        wait_for(lambda: "jaxstream: ready" in up.log() or not up.alive(), 300, "jaxstream up to say it is ready", interval=0.25)
    except AssertionError:
        up.stop()
        raise AssertionError(f"jaxstream up never became healthy:\n{up.log()[-3000:]}") from None
    assert up.alive(), f"jaxstream up exited:\n{up.log()[-3000:]}"
    return up, base_url


def start_service(module: str, overrides: list[str]) -> Process:
    return Process([sys.executable, "-u", "-m", module, *overrides], module)


def serve(redis_url: str | None, *overrides: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """A module fixture's body: `jaxstream up` with these overrides (and this environment, else
    the test's), yielding its base URL. At the end it must stop cleanly, and no service may have
    hit an unhandled error."""
    for _, base_url in serve_process(redis_url, *overrides, env=env):
        yield base_url


def serve_process(redis_url: str | None, *overrides: str, env: dict[str, str] | None = None) -> Iterator[tuple[Process, str]]:
    """As `serve`, yielding the `jaxstream up` process too (to signal its children)."""
    up, base_url = start_up(redis_url, *overrides, env=env)
    yield up, base_url
    code = up.stop()
    assert code == 0, f"jaxstream up exited {code} on SIGTERM:\n{up.log()[-3000:]}"
    assert "Traceback" not in up.log(), up.log()[-5000:]


def child_pid(parent: int, *args: str) -> int:
    """The pid of the child process of `parent` whose command line holds every one of `args`."""
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and all(arg in cmdline for arg in args):
            return int(proc.name)
    raise AssertionError(f"no child of {parent} runs {' '.join(args)}")


def children_of(pid: int) -> dict[str, int]:
    """module name -> pid of the `python -m <module>` children of `pid`."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"-m" in cmdline:
            found[cmdline[cmdline.index(b"-m") + 1].decode()] = int(proc.name)
    return found


def chat_prompt_ids(tokenizer, content: str) -> list[int]:
    """The token ids the tokenizer service makes of a one-message chat."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def generate_then_abort(base_url: str, rid: str, after: int = 5, **fields) -> dict:
    """A long streamed /generate with logprobs (and `fields`), aborted by `rid` through
    /abort_request once `after` tokens arrived; its last event, which must be the aborted request's
    partial output."""
    body = {"input_ids": [5], "stream": True, "rid": rid, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True}, **fields}
    last = None
    with httpx.stream("POST", base_url + "/generate", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            last = json.loads(line[6:])
            if len(last["output_ids"]) == after:
                assert httpx.post(base_url + "/abort_request", json={"rid": rid}, timeout=10).status_code == 200
    meta = last["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert len(last["output_ids"]) == meta["completion_tokens"] == len(meta["output_token_logprobs"]) >= after
    return last
