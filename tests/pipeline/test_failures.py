"""Services started one by one (as an operator scaling them would), then killed: health reports
the missing role, and a second tokenizer shares the stream and takes over what a dead one held."""

import json
import signal
import threading
import time

import httpx
import numpy as np
import pytest
from redis import Redis

from jaxstream import protocol
from jaxstream.arrays import to_wire
from jaxstream.heartbeat import read_heartbeat
from jaxstream.redis_server import EmbeddedRedis, free_port
from jaxstream.transport import FIELD
from tests.support import assert_idle, healthy, is_idle, running, stack_overrides, start_service, wait_for

pytestmark = pytest.mark.pipeline
MODULES = ("gateway", "tokenizer_svc", "scheduler_svc", "worker_svc", "detokenizer_svc")


class Services:
    def __init__(self, redis_url: str) -> None:
        port = free_port()
        # Separate processes with no supervisor (as compose runs them): a killed one is seen dead when
        # its heartbeat expires, here after 3 s (redis.heartbeat_ttl_ms, 10 s by default) to keep the
        # tests short; /health_generate gives up well before that.
        # A gateway stopped drains its streams for 1 s only (then ends them with an error).
        self.overrides = stack_overrides(redis_url, port, "worker=fake", "server.health_generate_timeout_s=1",
                                         "redis.heartbeat_ttl_ms=3000", "server.drain_timeout_s=1")
        self.namespace = next(o.split("=", 1)[1] for o in self.overrides if o.startswith("redis.namespace="))
        self.base_url = f"http://127.0.0.1:{port}"
        self.gateway_urls = [self.base_url]
        self.redis = Redis.from_url(redis_url)
        self.procs = [start_service(m, self.overrides) for m in MODULES]

    def add(self, module: str):
        proc = start_service(module, self.overrides)
        self.procs.append(proc)
        return proc

    def add_gateway(self, port: int):
        overrides = [o for o in self.overrides if not o.startswith("server.port=")] + [f"server.port={port}"]
        proc = start_service("gateway", overrides)
        self.procs.append(proc)
        self.gateway_urls.append(f"http://127.0.0.1:{port}")
        return proc

    def by_module(self, module: str):
        return next(p for p in self.procs if p.name == module)

    def tokenizer_stats(self) -> dict[str, dict[str, int]]:
        """Each tokenizer's counters (its stats also hold model facts, such as eos_token_ids [2])."""
        stats = httpx.get(self.base_url + "/stats", timeout=5).json()["tokenizer"]
        return {name: {k: s[k] for k in ("processed", "reclaimed")} for name, s in stats.items()}

    def consumer_of(self, pid: int) -> str:
        for key in self.redis.scan_iter(match=f"{self.namespace}:hb:tokenizer.*"):
            if (value := self.redis.get(key)) and read_heartbeat(value.decode())[0] == pid:
                return key.decode().rsplit(":", 1)[1]
        raise AssertionError(f"no heartbeat for pid {pid}")

    def pending_of(self, consumer: str) -> int:
        for c in self.redis.xinfo_consumers(f"{self.namespace}:stream:tokenizer", "tokenizer"):
            if c["name"].decode() == consumer:
                return c["pending"]
        return 0

    def stop(self) -> None:
        # All at once: each takes up to a blocking read (~1 s) to notice.
        for proc in self.procs:
            proc.signal(signal.SIGCONT)
            proc.signal(signal.SIGTERM)
        for proc in self.procs:
            proc.wait()


def answers(base_url: str) -> bool:
    """The gateway is up (healthy or not: a test may have killed another service)."""
    try:
        httpx.get(base_url + "/health", timeout=5)
        return True
    except httpx.HTTPError:
        return False


@pytest.fixture
def services(redis_url):
    s = Services(redis_url)
    try:
        # A fake-worker stack is healthy in ~8 s; once, in a whole-suite run on a slow day, it was not
        # within 60 (cause not found: the run's logs were not kept; the file alone passed at once).
        wait_for(lambda: healthy(s.base_url), 120, "the services to be healthy", interval=0.25)
        yield s
        # Whatever failed, once what still runs is aborted nothing is left and no page leaked.
        url = next(u for u in s.gateway_urls if answers(u))  # a test may have killed the first gateway
        httpx.post(url + "/abort_request", json={"abort_all": True}, timeout=10).raise_for_status()
        assert_idle(url)
    finally:
        s.stop()


def complete(base_url: str, prompt: list[int], max_tokens: int = 3) -> dict:
    r = httpx.post(base_url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_killing_the_tokenizer_turns_health_503_naming_it(services):
    assert complete(services.base_url, [1, 2, 3])["choices"][0]["finish_reason"] == "length"
    services.by_module("tokenizer_svc").signal(signal.SIGKILL)
    started = time.monotonic()

    def unhealthy():
        r = httpx.get(services.base_url + "/health", timeout=5)
        return r.status_code == 503 and r.json()

    body = wait_for(unhealthy, 8, "/health to answer 503")
    assert body["missing"] == ["tokenizer"]
    assert time.monotonic() - started < 5  # heartbeat TTL is 3 s
    time.sleep(1.2)  # the gateway's watchdog looks once a heartbeat
    r = httpx.post(services.base_url + "/v1/completions", json={"prompt": [1], "max_tokens": 2}, timeout=5)
    assert r.status_code == 503 and "tokenizer" in r.json()["error"]["message"] and r.headers["retry-after"]


def test_two_tokenizers_share_the_stream_and_a_killed_ones_entries_are_claimed(services):
    second = services.add("tokenizer_svc")
    wait_for(lambda: len(services.tokenizer_stats()) == 2, 60, "two live tokenizers", interval=0.25)

    # 1. Both take requests from the one stream.
    threads = [threading.Thread(target=complete, args=(services.base_url, [100 + i])) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(1.5)  # stats travel with the heartbeat
    processed = [s["processed"] for s in services.tokenizer_stats().values()]
    assert len(processed) == 2 and all(n > 0 for n in processed) and sum(processed) == 24, processed

    # 2. A tokenizer is frozen while it holds a request, then killed: the other one takes it over.
    tokenizers = {p.pid: p for p in (services.by_module("tokenizer_svc"), second)}
    names = {pid: services.consumer_of(pid) for pid in tokenizers}
    for attempt in range(10):
        for proc in tokenizers.values():
            proc.signal(signal.SIGSTOP)
        result: dict = {}
        request = threading.Thread(target=lambda: result.update(complete(services.base_url, [7000 + attempt], 4)))
        request.start()
        try:
            holder = wait_for(lambda: next((pid for pid, n in names.items() if services.pending_of(n)), None),
                              1.5, "a frozen tokenizer to hold the request")
        except AssertionError:
            holder = None  # neither was blocked in its read when frozen: the entry waits unread
        if holder is None:
            for proc in tokenizers.values():
                proc.signal(signal.SIGCONT)
            request.join(30)
            continue
        tokenizers[holder].signal(signal.SIGKILL)
        survivor = next(p for pid, p in tokenizers.items() if pid != holder)
        survivor.signal(signal.SIGCONT)
        request.join(30)
        assert result["choices"][0]["text"] and result["usage"]["completion_tokens"] == 4
        time.sleep(1.5)
        assert services.tokenizer_stats()[names[survivor.pid]]["reclaimed"] >= 1
        return
    pytest.fail("no tokenizer was caught holding a request in 10 attempts")


def long_stream(base_url: str, events: list[str]) -> None:
    body = {"prompt": [42], "max_tokens": 8000, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.HTTPError as exc:
        events.append(f"transport error: {exc!r}")


def test_a_stopped_gateway_ends_its_open_streams_with_an_error_not_a_cut_once_its_drain_times_out(services):
    port = free_port()
    services.add_gateway(port)  # the fixture's clean-up needs a gateway that still answers
    other_url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(other_url), 30, "a second gateway")
    events: list[str] = []
    streaming = threading.Thread(target=long_stream, args=(services.base_url, events), daemon=True)
    streaming.start()
    wait_for(lambda: len(events) > 3, 10, "the stream to flow")
    gateway = services.by_module("gateway")
    assert gateway.stop() == 0  # SIGTERM, as `jaxstream up` stops it
    streaming.join(10)
    assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"], events[-3:]
    assert "Traceback" not in gateway.log(), gateway.log()[-3000:]
    wait_for(lambda: running(other_url) == 0, 10, "the scheduler to abort the stopped gateway's request")


def test_a_dead_gateways_requests_are_aborted(services):
    port = free_port()
    services.add_gateway(port)
    other_url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(other_url), 30, "a second gateway")
    events: list[str] = []
    threading.Thread(target=long_stream, args=(services.base_url, events), daemon=True).start()
    wait_for(lambda: running(other_url) == 1, 10, "the long request to run")
    services.by_module("gateway").signal(signal.SIGKILL)
    started = time.monotonic()
    wait_for(lambda: is_idle(other_url), 10, "the scheduler to drop the dead gateway's request")
    assert time.monotonic() - started < 6  # heartbeat TTL 3 s + one check per heartbeat
    assert len(events) < 8000


def test_a_dead_worker_fails_requests_in_flight_and_a_new_one_serves(services):
    events: list[str] = []
    streaming = threading.Thread(target=long_stream, args=(services.base_url, events), daemon=True)
    streaming.start()
    plain: dict = {}

    def non_streaming() -> None:
        r = httpx.post(services.base_url + "/v1/completions", json={"prompt": [43], "max_tokens": 8000, "ignore_eos": True}, timeout=60)
        plain.update(status=r.status_code, body=r.json())

    blocking = threading.Thread(target=non_streaming, daemon=True)
    blocking.start()
    # The stream's 200 goes out with its first output: before that, a failure is a 503, not an event.
    wait_for(lambda: running(services.base_url) == 2 and events, 10, "both requests to run, the stream to flow")
    services.by_module("worker_svc").signal(signal.SIGKILL)
    started = time.monotonic()
    streaming.join(10)
    blocking.join(10)
    assert time.monotonic() - started < 6
    assert events[-1] == "[DONE]" and "worker stopped" in json.loads(events[-2])["error"]["message"], events[-3:]
    assert plain["status"] == 503 and "worker stopped" in plain["body"]["error"]["message"]
    r = httpx.get(services.base_url + "/health", timeout=5)
    assert r.status_code == 503 and r.json()["missing"] == ["worker"]
    # A step the dead worker never read (the scheduler sends one on each result): its seqs name slots
    # whose sampling parameters only that worker had. The new worker drops it and serves on.
    stale = protocol.Step(10_000, (protocol.StepSeq("gone", 0, 1, 9, True, slot=0),), to_wire(np.zeros(1, np.int32)),
                          to_wire(np.full(1, 8, np.int32)), to_wire(np.zeros((1, 1), np.int32)))
    services.redis.xadd(f"{services.namespace}:stream:worker:0", {FIELD: protocol.encode(stale)})

    worker = services.add("worker_svc")
    wait_for(lambda: healthy(services.base_url), 60, "a new worker")
    assert complete(services.base_url, [9, 9], 5)["usage"]["completion_tokens"] == 5
    wait_for(lambda: is_idle(services.base_url), 10, "every page free again")
    assert worker.alive() and "step 10000: request gone's slot 0 holds no sampling parameters" in worker.log()


def test_a_starting_worker_answers_503_saying_how_far_it_got_not_that_it_is_missing(services):
    services.by_module("worker_svc").stop()  # SIGTERM: its heartbeat key goes at once

    def generate() -> httpx.Response:
        return httpx.post(services.base_url + "/v1/completions", json={"prompt": [1], "max_tokens": 2}, timeout=10)

    def message() -> str:
        r = generate()
        assert r.status_code == 503 and r.headers["retry-after"], r.text
        return r.json()["error"]["message"]

    wait_for(lambda: message() == "service unavailable: no worker running", 8, "the worker to be missing")
    # What a JAX worker publishes while it compiles (a fake one gets past its phases in a blink)
    key = f"{services.namespace}:starting:worker.0.00c0ffee"
    services.redis.set(key, "99999999 compiling step shapes 40/66", px=60_000)  # the process id, then the phase
    assert message() == "the worker is starting: compiling step shapes 40/66"
    r = httpx.get(services.base_url + "/health", timeout=5)
    assert r.status_code == 503 and r.headers["retry-after"]
    assert r.json() == {"status": "starting", "missing": ["worker"], "starting": {"worker": "compiling step shapes 40/66"}}
    services.redis.delete(key)
    assert message() == "service unavailable: no worker running"
    # A real (fake) worker says it is starting from its first heartbeat's time until it is ready. Its
    # start takes a tenth of a second past its imports, which a poll over HTTP could miss: so it is
    # stopped (SIGSTOP) as soon as its starting key is in Redis, asked, then let go.
    worker = services.add("worker_svc")
    wait_for(lambda: list(services.redis.scan_iter(match=f"{services.namespace}:starting:worker*")), 30,
             "the new worker's starting key", interval=0.001)
    worker.signal(signal.SIGSTOP)
    try:
        assert message() in ("the worker is starting", "the worker is starting: reading the tokenizer's vocabulary size")
    finally:
        worker.signal(signal.SIGCONT)
    wait_for(lambda: healthy(services.base_url), 60, "the new worker")
    assert generate().status_code == 200
    # Ready, it no longer says it is starting (not merely once the key's TTL ran out).
    wait_for(lambda: not list(services.redis.scan_iter(match=f"{services.namespace}:starting:*")), 1, "the phase to go",
             interval=0.05)


def test_detokenizers_scale_out_and_a_dead_one_fails_only_its_requests(services):
    second = services.add("detokenizer_svc")

    def detokenizers() -> dict[str, dict]:
        return httpx.get(services.base_url + "/stats", timeout=5).json()["detokenizer"]

    wait_for(lambda: len(detokenizers()) == 2, 60, "two live detokenizers", interval=0.25)
    time.sleep(1.5)  # the scheduler looks its peers up once a heartbeat
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.update({i: complete(services.base_url, [300 + i], 5)})) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, body in results.items():
        assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"
    time.sleep(1.5)
    assert all(s["started"] > 0 for s in detokenizers().values())

    streams = [[] for _ in range(4)]
    for events in streams:
        threading.Thread(target=long_stream, args=(services.base_url, events), daemon=True).start()
    wait_for(lambda: running(services.base_url) == 4, 10, "four long requests to run")
    # Killed before a stream's first output reached its client, the request would be refused with an
    # HTTP 503 (openai_routes: a rejection before the first output is not a 200 stream), not end with
    # an SSE error event: on a loaded machine the detokenizer can be that far behind the scheduler.
    wait_for(lambda: all(len(e) > 1 for e in streams), 20, "every stream to flow")
    second.signal(signal.SIGKILL)
    # Its heartbeat expires 3 s after the kill and the scheduler looks once a heartbeat; the rest of
    # the wait is slack for a loaded machine. (A 10 s wait timed out once in a whole-suite run, most
    # likely the race above: two streams refused with a 503 never end with [DONE].)
    wait_for(lambda: sum(1 for e in streams if e and e[-1] == "[DONE]") >= 2, 30, "the dead detokenizer's requests to fail")
    failed = [e for e in streams if e and e[-1] == "[DONE]"]
    survivors = [e for e in streams if not (e and e[-1] == "[DONE]")]
    assert len(failed) == 2, [e[-3:] for e in streams]  # round robin: half of them were on the dead one
    for events in failed:
        assert "detokenizer" in json.loads(events[-2]).get("error", {}).get("message", ""), ([len(e) for e in streams], events[-3:])
    wait_for(lambda: running(services.base_url) == 2, 5, "the scheduler to have dropped them")
    assert all(e and e[-1] != "[DONE]" for e in survivors)  # the others go on
    assert healthy(services.base_url)


def test_a_redis_outage_fails_requests_in_flight_in_bounded_time_quietly_then_the_stack_serves_again():
    redis = EmbeddedRedis().start()
    services = Services(redis.url)
    try:
        wait_for(lambda: healthy(services.base_url), 60, "the services to be healthy", interval=0.25)
        events: list[str] = []
        streaming = threading.Thread(target=long_stream, args=(services.base_url, events), daemon=True)
        streaming.start()
        wait_for(lambda: len(events) > 3, 10, "the stream to start")
        redis.stop()  # down, and back with no persistence: every stream, group and key is gone
        streaming.join(15)  # ended by the gateway once Redis was gone for a heartbeat TTL (3 s here)
        assert events[-1] == "[DONE]" and "Redis is unreachable" in json.loads(events[-2])["error"]["message"]
        redis = EmbeddedRedis(port=redis.port).start()
        wait_for(lambda: healthy(services.base_url), 20, "health after the restart", interval=0.25)
        body = wait_for(lambda: _try_complete(services.base_url), 20, "a request to succeed after the restart", interval=0.5)
        assert body["usage"]["completion_tokens"] == 3
        assert all(p.alive() for p in services.procs)
        for proc in services.procs:
            assert "Traceback" not in proc.log(), proc.log()[-3000:]
            # one line as Redis went, one as it came back: not one per retry of every loop
            assert proc.log().count("Redis unreachable (") == 1 and "Redis reachable again after" in proc.log(), proc.log()[-3000:]
    finally:
        services.stop()
        redis.stop()


def _try_complete(base_url: str) -> dict | None:
    r = httpx.post(base_url + "/v1/completions", json={"prompt": [11, 12], "max_tokens": 3}, timeout=30)
    return r.json() if r.status_code == 200 else None


def test_health_generate_times_out_and_aborts_its_generation(services):
    assert httpx.get(services.base_url + "/health_generate", timeout=10).status_code == 200
    worker = services.by_module("worker_svc")
    worker.signal(signal.SIGSTOP)
    try:
        r = httpx.get(services.base_url + "/health_generate", timeout=10)
        assert r.status_code == 503 and "within 1 s" in r.json()["error"]["message"] and r.headers["retry-after"]
    finally:
        worker.signal(signal.SIGCONT)
    wait_for(lambda: is_idle(services.base_url), 10, "the timed-out generation to be aborted and its pages freed")
    assert httpx.get(services.base_url + "/health_generate", timeout=10).status_code == 200


def test_short_requests_ended_on_a_dead_detokenizer_fail_without_further_traffic(services):
    # Killed, the detokenizer is still taken for live until its heartbeat expires (3 s here): short
    # requests admitted meanwhile end at the scheduler at once, their outputs gone with it. With no
    # other message coming, the idle scheduler must still notice and fail them, not leave them waiting.
    services.by_module("detokenizer_svc").signal(signal.SIGKILL)
    started = time.monotonic()
    answers = []
    threads = [threading.Thread(target=lambda i=i: answers.append(httpx.post(
        services.base_url + "/v1/completions", json={"prompt": [70 + i], "max_tokens": 3}, timeout=15))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in answers] == [503, 503], [r.text for r in answers]
    assert all("detokenizer" in r.json()["error"]["message"] for r in answers)
    assert time.monotonic() - started < 10  # the TTL and a heartbeat's look, not a client's timeout
