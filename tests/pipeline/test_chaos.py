"""Chaos under `jaxstream up` (fake worker): 32 streams run, one process is killed (SIGKILL), each
service in turn and then the embedded Redis. Every client gets a whole answer or a clean error
ending (an SSE error event and [DONE]), never a cut or a hang: a killed gateway is the exception,
its own connections die with it, and its clients see the connection close. The supervisor heals
the stack without a human: /health is 200 again, later requests all succeed, and at the end no
page is leaked. Then SIGTERM, as compose or Kubernetes send it: the gateway drains (streams in
flight finish whole, a new request gets a 503 with Retry-After), then everything stops."""

import json
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.support import assert_idle, children_of, healthy, start_up, wait_for

pytestmark = pytest.mark.pipeline
MODEL = "SmolLM2-135M-Instruct"
STREAMS = 32
VICTIMS = ("tokenizer_svc", "detokenizer_svc", "worker_svc", "scheduler_svc", "gateway", "redis-server")
HEAL_S = 30.0  # the bound asserted, twice the 15 s for a loaded CI machine; the note quotes the measured times


def stream_outcome(url: str, i: int, started: threading.Barrier) -> str:
    """'whole', 'error' (an error event, then [DONE]; or a 503), 'closed' (the connection died),
    or what went wrong: 'cut' (no [DONE]), 'silent' (a 200 whose stream ended without an end)."""
    body = {"model": MODEL, "prompt": [1000 + i], "max_tokens": 1000, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            if r.status_code != 200:
                started.wait()
                return "error" if r.status_code == 503 else f"status {r.status_code}"
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 1:
                        started.wait()
            if not events or events[-1] != "[DONE]":
                return "cut"
            payloads = [json.loads(e) for e in events[:-1]]
            if any("error" in p for p in payloads):
                return "error"
            return "whole" if payloads[-1]["choices"][0]["finish_reason"] == "length" else "silent"
    except threading.BrokenBarrierError:
        return "never started"
    except httpx.TransportError:
        return "closed"


def pid_of(up_pid: int, victim: str) -> int:
    if victim == "redis-server":
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == up_pid and \
                            b"redis-server" in (proc / "cmdline").read_bytes():
                        return int(proc.name)
                except OSError:
                    continue
        raise AssertionError("no embedded redis-server")
    return children_of(up_pid)[victim]


@pytest.fixture(scope="module")
def stack():
    # Steps slowed to 5 ms: 32 streams of 1000 tokens are still running when the kill comes.
    up, url = start_up(None, "worker=fake", "worker.step_delay_ms=5")
    try:
        yield up, url
    finally:
        up.stop()


def start_streams(url: str, count: int) -> tuple[list[threading.Thread], list[str]]:
    """`count` streams, returned once each has its first event; their outcomes land in the list."""
    started = threading.Barrier(count + 1, timeout=60)
    outcomes: list[str] = []
    threads = [threading.Thread(target=lambda i=i: outcomes.append(stream_outcome(url, i, started))) for i in range(count)]
    for t in threads:
        t.start()
    started.wait()
    return threads, outcomes


def test_killing_each_service_and_redis_under_load_heals_without_a_human(stack):
    up, url = stack
    healed = {}
    for victim in VICTIMS:
        threads, outcomes = start_streams(url, STREAMS)
        subprocess.run(["kill", "-9", str(pid_of(up.pid, victim))], check=True)
        killed = time.monotonic()
        time.sleep(0.5)  # the supervisor sees the death within 0.2 s; until then /health may still say 200
        wait_for(lambda: healthy(url), HEAL_S, f"/health 200 after killing the {victim}", interval=0.1)
        healed[victim] = round(time.monotonic() - killed, 1)
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads), f"{victim}: a client hangs"
        allowed = {"whole", "error"} | ({"closed"} if victim == "gateway" else set())
        assert set(outcomes) <= allowed and len(outcomes) == STREAMS, (victim, Counter(outcomes))
        with httpx.Client(base_url=url, timeout=30) as http:
            for i in range(8):
                r = http.post("/v1/completions", json={"model": MODEL, "prompt": [50 + i], "max_tokens": 3})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None, (victim, r.text)
    assert_idle(url)
    print("healthy again after (s):", healed)
    log = up.log()
    assert all(f"restarting {unit}" in log for unit in ("tokenizer", "detokenizer", "replica 0", "gateway", "redis"))
    assert up.alive()


def test_a_3_s_stall_of_the_worker_fails_nothing(stack):
    # A GC pause or a busy CPU stops a process for a while: within the heartbeat TTL (10 s by
    # default) nobody takes it for dead, and the streams it serves just wait. (The worker holds the
    # most; the scheduler and detokenizer are judged by the same heartbeat.)
    up, url = stack
    threads, outcomes = start_streams(url, 4)
    pid = pid_of(up.pid, "worker_svc")
    os.kill(pid, signal.SIGSTOP)
    time.sleep(3)
    os.kill(pid, signal.SIGCONT)
    for t in threads:
        t.join(90)
    assert outcomes == ["whole"] * 4, outcomes
    assert "exited" not in up.log().rpartition("healthy again")[2]


def test_sigterm_drains_the_streams_in_flight_then_stops(stack):
    up, url = stack
    threads, outcomes = start_streams(url, 4)
    up.proc.send_signal(signal.SIGTERM)  # the supervisor stops the gateway first: it drains
    wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 503, 10, "/health to say draining")
    health = httpx.get(url + "/health", timeout=5)
    assert health.json()["status"] == "draining" and health.headers["Retry-After"]
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [7], "max_tokens": 3}, timeout=10)
    assert r.status_code == 503 and r.headers["Retry-After"] and "shutting down" in r.json()["error"]["message"]
    for t in threads:
        t.join(90)
    assert outcomes == ["whole"] * 4
    assert up.proc.wait(30) == 0 and "jaxstream: stopped" in up.log()
