"""Data parallelism: `jaxstream up worker=fake parallelism=dp2` runs two scheduler+worker pairs behind
one gateway, tokenizer and detokenizer. Which replica ran a request is read from each scheduler's
heartbeat stats (`requests_total`, `/v1/loads`), never mocked."""

import asyncio
import os
import signal
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest

from tests.support import child_pid, generate_then_abort, healthy, serve_process, wait_for

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def dp2(redis_url):
    # 5 ms a step: a long request stays in flight (8000 tokens, 40 s) while a test looks at it. A
    # stalled (stopped) process is seen by its heartbeat alone: after 3 s here (10 s by default).
    yield from serve_process(redis_url, "worker=fake", "parallelism=dp2", "worker.step_delay_ms=5", "redis.heartbeat_ttl_ms=3000")


@pytest.fixture(scope="module")
def stack(dp2):
    return dp2[1]


def admitted(base_url: str) -> list[int]:
    """Requests each replica's scheduler has taken so far (as of its last heartbeat)."""
    stats = httpx.get(base_url + "/stats", timeout=5).json()["scheduler"]
    by_replica = {int(name.split(".")[1]): s["requests_total"] for name, s in stats.items()}
    return [by_replica[r] for r in range(2)]


def running(base_url: str) -> list[int]:
    loads = httpx.get(base_url + "/v1/loads", timeout=5).json()["loads"]
    assert [load["dp_rank"] for load in loads] == [0, 1]
    return [load["num_running_reqs"] for load in loads]


def added(base_url: str, before: list[int], expected: list[int]) -> None:
    wait_for(lambda: [a - b for a, b in zip(admitted(base_url), before)] == expected, 10,
             f"the replicas to have taken {expected} more requests", interval=0.2)


def generate(base_url: str, rid: str, results: dict, max_new_tokens: int = 8000) -> None:
    body = {"input_ids": [42], "rid": rid, "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
    results[rid] = httpx.post(base_url + "/generate", json=body, timeout=120).json()


@contextmanager
def replica_0_busy(base_url: str):
    """One long request running on replica 0 and nothing else in flight, so that the next request
    goes to replica 1 (fewer in flight there). The first long request lands where the rotation
    stands; if that is replica 1, a second one goes to replica 0 and the first is aborted."""
    results: dict = {}
    started = []

    def start(rid: str) -> None:
        thread = threading.Thread(target=generate, args=(base_url, rid, results))
        thread.start()
        started.append(thread)

    def one_running() -> list[int] | None:
        now = running(base_url)
        return now if sum(now) == 1 else None

    start("hold-a")
    holder = "hold-a"
    if wait_for(one_running, 10, "the first long request to run") == [0, 1]:
        start("hold-b")
        wait_for(lambda: running(base_url) == [1, 1], 10, "the second long request to run on replica 0")
        httpx.post(base_url + "/abort_request", json={"rid": "hold-a"}, timeout=10)
        started[0].join(10)
        holder = "hold-b"
    try:
        yield
    finally:
        httpx.post(base_url + "/abort_request", json={"rid": holder}, timeout=10)
        for thread in started:
            thread.join(10)
    assert results[holder]["meta_info"]["finish_reason"]["type"] == "abort"


async def batch_answers(base_url: str) -> list[tuple[str, list[float]]]:
    """4 prompts x n=2, greedy: 8 pipeline requests from one HTTP request."""
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        r = await client.completions.create(model=MODEL, prompt=[[100 + 7 * i, 2000 + i] for i in range(4)], n=2,
                                            max_tokens=6, temperature=0, logprobs=1)
    return [(c.text, c.logprobs.token_logprobs) for c in sorted(r.choices, key=lambda c: c.index)]


async def chat_answers(base_url: str) -> list[str]:
    """4 concurrent greedy chats."""
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        answers = await asyncio.gather(*(
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Count to {i}"}],
                                           max_tokens=5, temperature=0) for i in range(4)))
    return [a.choices[0].message.content for a in answers]


def test_requests_spread_over_both_replicas_and_answer_as_one_replica_does(stack, fake_stack):
    before = admitted(stack)
    batch = asyncio.run(batch_answers(stack))
    # Both replicas take part. Not exactly 4 + 4: a request that ends before the last is routed
    # changes the loads (the alternation itself is tests/unit/test_replicas.py's).
    took = wait_for(lambda: (d := [a - b for a, b in zip(admitted(stack), before)]) and sum(d) == 8 and d, 10,
                    "the replicas to have taken the 8 requests", interval=0.2)
    assert min(took) >= 1, took
    before = admitted(stack)
    chats = asyncio.run(chat_answers(stack))
    wait_for(lambda: sum(admitted(stack)) - sum(before) == 4, 5, "the chats to be counted", interval=0.2)
    assert all(text for text, _ in batch) and all(chats)
    assert batch == asyncio.run(batch_answers(fake_stack))  # a one-replica stack's answers
    assert chats == asyncio.run(chat_answers(fake_stack))


def test_operations_routes_show_each_replica(stack, tokenizer_info):
    info = httpx.get(stack + "/get_server_info", timeout=10).json()
    assert info["dp_size"] == 2 and [s["replica"] for s in info["internal_states"]] == [0, 1]
    assert httpx.get(stack + "/get_model_info", timeout=10).json()["max_model_len"] == tokenizer_info.context_length
    metrics = httpx.get(stack + "/metrics", timeout=10).text
    for replica in (0, 1):
        assert f'jaxstream:num_requests_running{{model_name="{MODEL}",replica="{replica}"}} 0.0' in metrics
    assert httpx.get(stack + "/health_generate", timeout=30).status_code == 200
    tokens = httpx.post(stack + "/tokenize", json={"prompt": "hi there"}, timeout=10).json()["tokens"]
    assert httpx.post(stack + "/detokenize", json={"tokens": tokens}, timeout=10).json()["text"] == "hi there"


def test_a_stop_string_and_an_abort_by_rid_on_replica_1(stack, tokenizer_info):
    tok = tokenizer_info.tokenizer
    full = tok.decode([6001 + i for i in range(12)], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    stop = tok.decode([6006]).strip()
    assert stop and stop in full
    client = openai.OpenAI(base_url=stack + "/v1", api_key="unused", max_retries=0, timeout=60)
    with replica_0_busy(stack):
        before = admitted(stack)
        # 1. A stop string: the detokenizer ends it, and tells replica 1's scheduler, which would
        # otherwise go on for 5000 tokens (25 s).
        r = client.completions.create(model=MODEL, prompt=[4000, 6000], max_tokens=5000, stop=[stop],
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[: full.index(stop)]
        added(stack, before, [0, 1])
        wait_for(lambda: running(stack) == [1, 0], 3, "replica 1 to have stopped the request")

        # 2. /abort_request by rid: the gateway sends it to replica 1, which holds the request.
        generate_then_abort(stack, "dp-abort")
        added(stack, before, [0, 2])


def test_health_is_503_naming_a_stopped_replicas_worker_and_the_other_replica_serves(dp2):
    up, stack = dp2
    worker = child_pid(up.pid, "worker_svc", "parallelism.replica=1")
    os.kill(worker, signal.SIGSTOP)
    try:
        def unhealthy():
            r = httpx.get(stack + "/health", timeout=5)
            return r.status_code == 503 and r.json()

        assert wait_for(unhealthy, 8, "/health to answer 503")["missing"] == ["worker.1"]  # heartbeat TTL 3 s
        time.sleep(1.2)  # the gateway's watchdog looks once a heartbeat
        before = admitted(stack)
        for i in range(3):  # replica 1 cannot serve: every request goes to replica 0
            r = httpx.post(stack + "/v1/completions", json={"prompt": [7, 8 + i], "max_tokens": 3}, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        added(stack, before, [3, 0])
    finally:
        os.kill(worker, signal.SIGCONT)
    wait_for(lambda: healthy(stack), 10, "health once the worker runs again")


def test_a_weight_update_reaches_every_replica(stack):
    """Both replicas stage, then both swap: every request, on either replica, gets the new weights
    (the fake's `shift`) and reports the new version; pausing and continuing reach both too."""
    import numpy as np

    from jaxstream import rl

    assert rl.pause(stack, mode="retract")["status"] == "ok"
    reply = rl.push_weights(stack, {"shift": np.array(3, np.int64)}, weight_version="dp-v1")
    assert reply["success"] and "dp-v1" in reply["message"]
    rl.continue_generation(stack)
    workers = httpx.get(stack + "/stats", timeout=5).json()["worker"]
    assert len(workers) == 2 and {w["weight_version"] for w in workers.values()} == {"dp-v1"}
    before = admitted(stack)
    outs = [httpx.post(stack + "/generate", json={"input_ids": [100 + i], "sampling_params": {"max_new_tokens": 2}}, timeout=30).json()
            for i in range(4)]
    added(stack, before, [2, 2])  # both replicas served
    assert [o["output_ids"] for o in outs] == [[104 + i, 108 + i] for i in range(4)]
    assert {o["meta_info"]["weight_version"] for o in outs} == {"dp-v1"}
    bad = httpx.post(stack + "/update_weights_from_tensor", content=rl.encode({"bias": np.zeros(2)}), timeout=30)
    assert bad.status_code == 400 and bad.json()["message"].count("replica") == 2  # each replica refused it
    garbled = httpx.post(stack + "/update_weights_from_tensor", content=b"not safetensors", timeout=30)
    assert garbled.status_code == 400 and garbled.json()["error"]["param"] == "body"  # the gateway's: no replica saw it
    rl.push_weights(stack, {"shift": np.array(0, np.int64)}, weight_version="dp-v2")
    assert {w["weight_version"] for w in httpx.get(stack + "/stats", timeout=5).json()["worker"].values()} == {"dp-v2"}
