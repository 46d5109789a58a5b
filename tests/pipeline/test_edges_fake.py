"""Issue 41's edges under `jaxstream up worker=fake`, each as the fault campaign reported it: large
prompts beside streams, a frozen tokenizer, a release refused while requests run, an upload whose
client leaves, connections that send their headers or body too slowly, and the API keys' reach.

One stack for the module, as a user runs it: its own embedded Redis (with a password), a user key
in its environment, short header and body timeouts, steps slowed so that streams outlast what
happens beside them."""

import json
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support import children_of, healthy, serve_process, wait_for

pytestmark = pytest.mark.pipeline
MODEL = "SmolLM2-135M-Instruct"
KEY = "edges-user-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT_S = 2  # server.header_timeout_s and server.body_timeout_s here


@pytest.fixture(scope="module")
def stack():
    """Pages for 16 streams of 8000 tokens and more (the fake cache costs 128 bytes a page): with the
    default 1024, the long streams of test_large_prompts_delay_only_themselves filled the pool within
    ~10 s on a slowed machine, and then its large prompts queued behind their preemptions past the
    client's timeout."""
    env = {**os.environ, "JAXSTREAM_API_KEY": KEY}
    yield from serve_process(None, "worker=fake", "worker.step_delay_ms=10", f"server.header_timeout_s={TIMEOUT_S}",
                             f"server.body_timeout_s={TIMEOUT_S}", "scheduler.num_pages=16384", env=env)


def events(url: str, body: dict, seen: list[tuple[float, dict | str]], stop: threading.Event | None = None,
           timeout: float = 120) -> int:
    """Stream a completion: every event with the time it came, until [DONE] or `stop`; the status."""
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=timeout) as response:
        if response.status_code != 200:
            return response.status_code
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                seen.append((time.monotonic(), data if data == "[DONE]" else json.loads(data)))
                if stop is not None and stop.is_set():
                    break
    return 200


def in_threads(*calls) -> list[threading.Thread]:
    threads = [threading.Thread(target=call) for call in calls]
    for t in threads:
        t.start()
    return threads


def test_large_prompts_delay_only_themselves(stack):
    """A 30 MB prompt and ten of 3 MB sent beside 16 streams: the streams' tokens keep coming (no
    gap of a second); each large one gets its answer, or a 400 naming the limit.

    The gap is a time on a shared 2-core machine: a sending whose window some other process stalled
    (seen inside the whole suite: one gap of 2.8 s, where alone the longest is ~0.2 s) is sent once
    more. Large prompts that held the streams up would do so every time."""
    _, url = stack
    stop = threading.Event()
    streams: list[list] = [[] for _ in range(16)]
    body = {"model": MODEL, "max_tokens": 8000, "ignore_eos": True, "stream": True}
    runs = in_threads(*[lambda i=i: events(url, {**body, "prompt": [100 + i]}, streams[i], stop) for i in range(16)])
    wait_for(lambda: all(streams), 30, "the 16 streams' first tokens")

    word = "word "
    # Encoded before: this process's JSON encoding would hold its GIL, and the streams' readers with it
    bodies = {"30 MB": ("/v1/completions", {"prompt": word * 6_000_000}),
              "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": word * 600_000}]}),
              "truncated": ("/v1/completions", {"prompt": word * 600_000, "truncate_prompt_tokens": 16})}
    bodies = {kind: (path, json.dumps({"model": MODEL, "max_tokens": 2, **payload}).encode()) for kind, (path, payload) in bodies.items()}

    def send_all() -> tuple[float, float, float]:
        """Send the eleven, check their answers; (the streams' longest gap in the meantime, when
        after the sends it began, how long the eleven took)."""
        answers: dict[str, list] = {"30 MB": [], "chat": [], "truncated": []}

        def post(kind: str) -> None:
            path, body = bodies[kind]
            answers[kind].append(httpx.post(url + path, content=body, headers={**AUTH, "Content-Type": "application/json"},
                                            timeout=120))

        started = time.monotonic()
        large = in_threads(lambda: post("30 MB"), *[lambda: post("chat") for _ in range(5)], *[lambda: post("truncated") for _ in range(5)])
        for t in large:
            t.join(180)
        ended = time.monotonic()
        for kind in ("30 MB", "chat"):  # no context holds them: refused before any tokenization, naming the limit
            for r in answers[kind]:
                error = r.json()["error"]
                assert r.status_code == 400 and error["code"] == "context_length_exceeded", (kind, r.text[:300])
                assert "server.max_chars_per_token" in error["message"] and "maximum context length is 8192 tokens" in error["message"]
        assert [r.status_code for r in answers["truncated"]] == [200] * 5  # tokenized whole (in the large lane), then cut
        assert all(r.json()["usage"]["prompt_tokens"] == 16 for r in answers["truncated"])
        gaps = [(b[0] - a[0], a[0] - started) for seen in streams for a, b in zip(seen, seen[1:]) if started <= b[0] <= ended + 1]
        assert gaps, "no stream token came while the large prompts were sent"
        return *max(gaps), ended - started

    try:  # the streams end whatever happens, so a failure here leaves the next tests a stack at rest
        tries = [send_all()]
        if tries[0][0] >= 1.0:
            tries.append(send_all())
    finally:
        stop.set()
        for t in runs:
            t.join(30)
    assert all(len(seen) > 20 for seen in streams)
    assert min(gap for gap, _, _ in tries) < 1.0, tries  # (the longest gap, when after the sends, how long they took) per sending
    print("; ".join(f"large prompts answered in {took:.1f} s, the 16 streams' longest gap {gap * 1000:.0f} ms" for gap, _, took in tries))


def test_a_refused_release_leaves_no_hold(stack):
    """/release_memory_occupation refused (a request runs) while 20 new requests come: none of them
    is told the memory was released (the campaign saw 20 of 20)."""
    _, url = stack
    stop = threading.Event()
    running: list = []
    runs = in_threads(lambda: events(url, {"model": MODEL, "prompt": [9], "max_tokens": 8000, "ignore_eos": True, "stream": True},
                                     running, stop))
    wait_for(lambda: running, 30, "a request running")
    outcomes: list[httpx.Response] = []
    for _ in range(3):
        releases: list[httpx.Response] = []
        threads = in_threads(lambda: releases.append(httpx.post(url + "/release_memory_occupation", json={}, headers=AUTH, timeout=30)),
                             *[lambda: outcomes.append(httpx.post(url + "/v1/completions", headers=AUTH, timeout=30,
                                                                  json={"model": MODEL, "prompt": [11], "max_tokens": 2}))
                               for _ in range(20)])
        for t in threads:
            t.join(60)
        assert releases[0].status_code == 400 and "running" in releases[0].json()["message"], releases[0].text
    stop.set()
    runs[0].join(30)
    assert [r.status_code for r in outcomes] == [200] * 60, {r.text for r in outcomes if r.status_code != 200}


def raw_socket(url: str) -> socket.socket:
    host, port = httpx.URL(url).host, httpx.URL(url).port
    return socket.create_connection((host, port), timeout=10)


def test_a_client_that_leaves_mid_upload_is_let_go_quietly(stack):
    up, url = stack
    for path in ("/update_weights_from_tensor", "/v1/completions"):
        with raw_socket(url) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                      "Content-Type: application/octet-stream\r\nContent-Length: 10000000\r\n\r\n".encode() + b"\0" * 100_000)
        time.sleep(0.5)
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 2}, headers=AUTH, timeout=30)
    assert r.status_code == 200 and healthy(url)
    gateway_log = "\n".join(line for line in up.log().splitlines() if line.startswith("[gateway]"))
    assert "Traceback" not in gateway_log and "unhandled error" not in gateway_log and " 500" not in gateway_log, gateway_log[-3000:]


def read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_slow_headers_and_bodies_are_cut(stack):
    """Connections that send their headers, or their body, a little at a time are answered 408 and
    closed after the timeouts, while others are served."""
    _, url = stack
    sockets = [raw_socket(url) for _ in range(20)]
    started = time.monotonic()
    for i, s in enumerate(sockets):
        if i % 2:  # headers never whole
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        else:  # headers whole, then a body that stops
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                      "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":".encode())
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 2}, headers=AUTH, timeout=30)
    assert r.status_code == 200  # served meanwhile
    for i, s in enumerate(sockets):
        s.sendall(b"X-Slow: 1\r\n" if i % 2 else b'"a')  # a trickle does not reset the headers' deadline
    answers = [read_all(s) for s in sockets]  # the server closes each
    took = time.monotonic() - started
    for s in sockets:
        s.close()
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), {a[:80] for a in answers}
    assert b"server.header_timeout_s" in answers[1] and b"server.body_timeout_s" in answers[0]
    assert TIMEOUT_S <= took < TIMEOUT_S + 5, took


def test_only_the_gateway_holds_the_api_keys(stack):
    up, url = stack
    children = children_of(up.pid)
    assert set(children) >= {"gateway", "tokenizer_svc", "scheduler_svc", "worker_svc", "detokenizer_svc"}
    for module, pid in children.items():
        environ = dict(entry.split("=", 1) for entry in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in entry)
        assert ("JAXSTREAM_API_KEY" in environ) == (module == "gateway"), module
        assert environ.get("JAXSTREAM_REDIS_PASSWORD"), module  # every service reaches Redis


def test_a_malformed_weight_bucket_is_the_clients_400_with_no_worker_traceback(stack):
    """Bytes that are no safetensors (a header nested past Python's recursion limit, a shape no
    array can have) were refused as "the worker failed: RecursionError: ..." with a traceback in the
    worker's log: now the client's 400, naming what is wrong, and nothing in the worker's log."""
    up, url = stack
    nested = b"[" * 100_000
    shapeless = json.dumps({"shift": {"dtype": "I64", "shape": [2**64, 0], "data_offsets": [0, 0]}}).encode()
    for header, named in ((nested, "not JSON"), (shapeless, "'shift'")):
        bucket = len(header).to_bytes(8, "little") + header
        r = httpx.post(url + "/update_weights_from_tensor", content=bucket, headers={**AUTH, "Content-Type": "application/octet-stream"},
                       timeout=30)
        body = r.json()
        assert r.status_code == 400 and body["success"] is False and named in body["message"], r.text
        assert "worker failed" not in body["message"] and body["error"]["param"] == "body"
    worker_log = "\n".join(line for line in up.log().splitlines() if line.startswith("[worker]"))
    assert "Traceback" not in worker_log and "failed" not in worker_log, worker_log[-3000:]
