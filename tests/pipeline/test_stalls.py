"""A service frozen under load (SIGSTOP) and let go (SIGCONT), under `jaxstream up` with the fake
worker: 16 streams run while the scheduler, the detokenizer or the tokenizer is stopped. Every
stream either completes with exactly the fake model's tokens in order (after token a: a + 1,
a + 2, ...) or ends with a clean SSE error event and [DONE], having sent only a prefix of them; a
new request succeeds within 15 s of SIGCONT; nothing is left running.

The stack reads with redis.block_ms=100, so the old socket timeout of a blocking read (block_ms +
5 s) is 5.1 s, and a heartbeat lives redis.heartbeat_ttl_ms=8500. Two stalls per service, in one
stack:
- PAST_READ_TIMEOUT (the issue's 8 s): past the old read timeout, within the heartbeat TTL. Nobody
  takes the service for dead, so nothing may fail. Before the fix the frozen scheduler lost a
  step result and wedged the stack for good, and the detokenizer put a late token at the end of
  every stream.
- PAST_HEARTBEAT (the issue's 20 s): past the heartbeat TTL. The service is taken for dead
  meanwhile (its requests may end with clean errors); once it runs again the stack serves again.

The three services stall at the same time, each in a stack of its own (one Redis, a namespace each):
the stalls are waits, and three at once cost the suite one service's time instead of three.
"""

import json
import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support import assert_idle, children_of, start_up, wait_for

pytestmark = pytest.mark.pipeline

STREAMS = 16
TOKENS = 150  # per stream: at 10 ms a step, still running when the stall starts
PAST_READ_TIMEOUT = 5.5
PAST_HEARTBEAT = 10.0


MODULES = ("scheduler_svc", "detokenizer_svc", "tokenizer_svc")
OVERRIDES = ("worker=fake", "worker.step_delay_ms=10", "redis.block_ms=100", "redis.heartbeat_ttl_ms=8500")


@pytest.fixture(scope="module")
def stalled(redis_url):
    """module -> what its stack saw (`stall_both`), the three stacks started, stalled and stopped at
    once; each must stop cleanly (exit 0 on SIGTERM), with no traceback in its log."""
    with ThreadPoolExecutor(len(MODULES)) as pool:
        ups = dict(zip(MODULES, pool.map(lambda _: start_up(redis_url, *OVERRIDES), MODULES)))
        try:
            yield dict(zip(MODULES, pool.map(lambda module: stall_both(*ups[module], module), MODULES)))
        finally:
            codes = dict(zip(MODULES, pool.map(lambda module: ups[module][0].stop(), MODULES)))
    for module, (up, _) in ups.items():
        assert codes[module] == 0, f"{module}'s stack exited {codes[module]} on SIGTERM:\n{up.log()[-3000:]}"
        assert "Traceback" not in up.log(), f"{module}'s stack: {up.log()[-3000:]}"


def stream(url: str, prompt: int, started: threading.Barrier) -> str:
    """'whole', 'error' (an error event then [DONE], or a 503 before the stream), or what went wrong."""
    body = {"input_ids": [prompt], "stream": True, "sampling_params": {"max_new_tokens": TOKENS, "ignore_eos": True}}
    right = list(range(prompt + 1, prompt + 1 + TOKENS))  # the fake model's arithmetic
    ids: list[int] = []
    events: list[dict] = []
    try:
        with httpx.stream("POST", url + "/generate", json=body, timeout=90) as r:
            if r.status_code != 200:
                started.wait()
                return "error" if r.status_code == 503 else f"status {r.status_code}: {r.read()[:200]!r}"
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                events.append(json.loads(line.removeprefix("data: ")))
                if len(events) == 1:
                    started.wait()
                if "error" not in events[-1]:
                    if events[-1]["output_ids"][: len(ids)] != ids:
                        return f"rewrote what it had sent: {ids[-5:]} then {events[-1]['output_ids'][-5:]}"
                    ids = events[-1]["output_ids"]
            else:
                return f"cut after {len(ids)} tokens"
    except httpx.HTTPError as exc:
        return f"transport error {exc!r} after {len(ids)} tokens"
    wrong = next((i for i, (a, b) in enumerate(zip(ids, right)) if a != b), None if len(ids) <= TOKENS else TOKENS)
    if wrong is not None:
        return f"wrong tokens from position {wrong}: {ids[wrong:wrong + 5]}, expected {right[wrong:wrong + 5]}"
    if "error" in events[-1]:
        return "error"
    finish = events[-1]["meta_info"]["finish_reason"]
    return "whole" if ids == right and finish["type"] == "length" else f"ended {finish} after {len(ids)} tokens"


def generate(url: str) -> bool:
    try:
        r = httpx.post(url + "/generate", json={"input_ids": [7], "sampling_params": {"max_new_tokens": 3}}, timeout=5)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and r.json()["output_ids"] == [8, 9, 10]


def freeze(up_pid: int, url: str, module: str, seconds: float, prompt: int) -> list[str]:
    """Start the streams, stop `module` for `seconds`, let it go; every stream's outcome."""
    started = threading.Barrier(STREAMS + 1, timeout=60)
    outcomes: list[str] = []
    threads = [threading.Thread(target=lambda i=i: outcomes.append(stream(url, prompt + 1000 * i, started)))
               for i in range(STREAMS)]
    for thread in threads:
        thread.start()
    started.wait()
    pid = children_of(up_pid)[module]
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()
    wait_for(lambda: generate(url), 15, f"a new request to succeed after the {module} resumed", interval=0.25)
    assert time.monotonic() - resumed < 15
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), f"{module}: a client hangs"
    assert children_of(up_pid)[module] == pid  # the same process went on: nobody restarted it
    return outcomes


def stall_both(up, url: str, module: str) -> dict:
    """Both stalls of `module` in its stack, in turn: {"within_ttl": outcomes, "past_ttl": outcomes},
    or {"failed": what an assertion said} where one did not hold (raised by the test, not the thread)."""
    seen: dict = {}
    try:
        seen["within_ttl"] = freeze(up.pid, url, module, PAST_READ_TIMEOUT, prompt=100)
        assert_idle(url)
        seen["past_ttl"] = freeze(up.pid, url, module, PAST_HEARTBEAT, prompt=200)
        assert_idle(url)
    except AssertionError as exc:
        seen["failed"] = str(exc)
    return seen


@pytest.mark.parametrize("module", MODULES)
def test_a_service_stalled_under_load_loses_nothing_and_the_stack_serves_on(stalled, module):
    seen = stalled[module]
    assert seen.get("within_ttl") == ["whole"] * STREAMS, seen
    past_ttl = seen.get("past_ttl")
    assert past_ttl is not None and set(past_ttl) <= {"whole", "error"} and len(past_ttl) == STREAMS, seen
    assert "failed" not in seen, seen
    print(f"{module} stopped {PAST_HEARTBEAT:g} s:", dict(Counter(past_ttl)))
