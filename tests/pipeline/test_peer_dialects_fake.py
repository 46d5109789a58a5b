"""The RL frameworks' own request shapes through the whole fake stack: AReaL's /generate rollout,
each peer's ignore_eos rule, vLLM's tokens-in/tokens-out route (SkyRL's rollouts), and the server
arguments slime, SkyRL and vLLM clients read at start-up. The fake worker continues a prompt whose
last token is t with t+1, t+2, ...; SmolLM2's EOS is 2 (worker_svc/fake.py)."""

import json

import httpx
import pytest

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
EOS = 2


@pytest.fixture(scope="module")
def stack(fake_stack):
    return fake_stack


def post(stack, path, body):
    return httpx.post(stack + path, json=body, timeout=60)


def test_an_areal_rollout_runs_with_its_empty_image_data_and_eos_among_its_stop_ids(stack):
    # areal/engine/sglang_remote.py's SGLangBackend.build_generation_request, for a text rollout
    body = {"input_ids": [0], "image_data": [], "return_logprob": True, "stream": False,
            "sampling_params": {"top_p": 1.0, "top_k": -1, "max_new_tokens": 5, "temperature": 1.0, "stop_token_ids": [EOS],
                                "ignore_eos": True, "skip_special_tokens": True, "frequency_penalty": 0.0}}
    out = post(stack, "/generate", body).json()
    assert out["output_ids"] == [1, 2, 3, 4, 5] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert [token for _, token, _ in out["meta_info"]["output_token_logprobs"]] == [1, 2, 3, 4, 5]
    stopped = post(stack, "/generate", {**body, "sampling_params": {**body["sampling_params"], "ignore_eos": False}}).json()
    assert stopped["output_ids"] == [1, 2] and stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    image = post(stack, "/generate", {**body, "image_data": ["data:image/png;base64,iVBORw0KGgo="]})
    assert image.status_code == 400 and image.json()["error"]["param"] == "image_data"


def test_ignore_eos_leaves_the_stop_token_ids_in_force_on_vllm_routes(stack):
    completion = post(stack, "/v1/completions", {"prompt": [0], "max_tokens": 5, "stop_token_ids": [3], "ignore_eos": True,
                                                  "return_token_ids": True}).json()
    assert completion["choices"][0]["token_ids"] == [1, 2, 3] and completion["choices"][0]["finish_reason"] == "stop"
    tokens = post(stack, "/inference/v1/generate", {"token_ids": [0], "sampling_params": {"max_tokens": 5, "stop_token_ids": [3],
                                                                                         "ignore_eos": True}}).json()
    assert tokens["choices"][0]["token_ids"] == [1, 2, 3] and tokens["choices"][0]["finish_reason"] == "stop"
    past_eos = post(stack, "/inference/v1/generate", {"token_ids": [0], "sampling_params": {"max_tokens": 5, "ignore_eos": True}}).json()
    assert past_eos["choices"][0]["token_ids"] == [1, 2, 3, 4, 5] and past_eos["choices"][0]["finish_reason"] == "length"


def test_vllm_tokens_route_answers_token_ids_and_logprobs_in_vllm_shape(stack):
    # skyrl's RemoteInferenceClient.sample: n samples, logprobs 0 (the sampled token's), prompt logprobs
    body = {"token_ids": [4, 5], "request_id": "skyrl-1", "model": "SmolLM2-135M-Instruct",
            "sampling_params": {"n": 2, "max_tokens": 3, "logprobs": 0, "prompt_logprobs": 1, "seed": 7, "output_kind": 2}}
    answer = post(stack, "/inference/v1/generate", body).json()
    assert answer["request_id"] == "skyrl-1" and answer["kv_transfer_params"] is None
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    for choice in answer["choices"]:
        assert choice["token_ids"] == [6, 7, 8] and choice["finish_reason"] == "length"
        content = choice["logprobs"]["content"]
        assert [c["token"] for c in content] == ["token_id:6", "token_id:7", "token_id:8"]
        assert [c["logprob"] for c in content] == pytest.approx([-0.6, -0.7, -0.8]) and all(c["top_logprobs"] == [] for c in content)
    first, second = answer["prompt_logprobs"]
    assert first is None and second["5"]["logprob"] == pytest.approx(-0.5) and second["5"]["rank"] == 1
    assert set(answer["metadata"]) == {"weight_version"}
    plain = post(stack, "/inference/v1/generate", {"token_ids": [9], "sampling_params": {"max_tokens": 2}}).json()
    assert plain["choices"][0]["logprobs"] is None and plain["prompt_logprobs"] is None and plain["choices"][0]["token_ids"] == [10, 11]


def test_server_info_carries_what_slime_and_vllm_clients_compare(stack):
    info = httpx.get(stack + "/server_info", timeout=30).json()
    # slime's external-engine check (sglang_engine.py): each argument it launches with equals the served one
    expected = {"enable_memory_saver": True, "dtype": "float32", "tp_size": 1, "dp_size": 1, "ep_size": 1, "pp_size": 1,
                "moe_dp_size": 1, "disaggregation_mode": "null", "enable_deterministic_inference": False,
                "enable_return_routed_experts": False, "world_size": 1}
    assert {key: info[key] for key in expected} == expected
    assert info["weight_version"] == httpx.get(stack + "/get_weight_version", timeout=30).json()["weight_version"]
    assert info["kv_bytes_per_token"] is None  # the fake worker holds no KV cache to count
    assert httpx.get(stack + "/get_server_info", timeout=30).json()["tp_size"] == 1
    vllm = httpx.get(stack + "/server_info?config_format=json", timeout=30).json()["vllm_config"]
    card = httpx.get(stack + "/v1/models", timeout=30).json()["data"][0]
    assert vllm["model_config"]["max_model_len"] == card["max_model_len"] and vllm["model_config"]["max_logprobs"] == 20
    assert (vllm["parallel_config"]["tensor_parallel_size"], vllm["parallel_config"]["data_parallel_size"]) == (1, 1)
    assert vllm["cache_config"]["enable_prefix_caching"] is True and vllm["speculative_config"]["method"] == "ngram"
    text = httpx.get(stack + "/server_info?config_format=text", timeout=30).json()["vllm_config"]
    assert json.loads(text) == vllm
    assert httpx.get(stack + "/server_info?config_format=yaml", timeout=30).json()["error"]["param"] == "config_format"
    assert httpx.get(stack + "/get_world_size", timeout=30).json() == {"world_size": 1}
    assert httpx.get(stack + "/get_world_size?include_dp=false", timeout=30).json() == {"world_size": 1}
