"""SGLang's rules and vLLM's where their clients rely on them, as the gateway reads a request (a stub
pipeline records the SamplingParams each route submits): the sources that decide each rule are named
in docs/api.md."""

import pytest
from starlette.testclient import TestClient

from gateway.app import build_app
from gateway.params import holds_media
from jaxstream.config import load_config
from jaxstream.keys import Keys
from tests.unit.test_fields import Recorder


@pytest.fixture(scope="module")
def recorded():
    pipeline = Recorder()
    return TestClient(build_app(None, pipeline, load_config(["worker=fake"]), None, Keys())), pipeline


def submitted(recorded, path, body):
    """The SamplingParams the route submitted (the stub answers 503 once it has them), or the refusal."""
    client, pipeline = recorded
    pipeline.sampling = None
    response = client.post(path, json=body)
    if response.status_code != 503:
        return response.json()["error"]
    return pipeline.sampling


def test_media_that_hold_no_item_are_no_input_and_a_real_one_is_refused(recorded):
    # SGLang's mm_utils.has_valid_data: null, [], and nested lists of nothing or of nulls hold no item
    for empty in (None, [], [[]], [None], [[None], []]):
        assert not holds_media(empty)
        for name in ("image_data", "video_data", "audio_data"):
            assert not isinstance(submitted(recorded, "/generate", {"input_ids": [5], name: empty}), dict), (name, empty)
    for real in ("https://x/cat.png", ["data:image/png;base64,AAAA"], [[None, "b64"]], {"url": "x"}, ""):
        refused = submitted(recorded, "/generate", {"input_ids": [5], "image_data": real})
        assert refused["param"] == "image_data" and "image input" in refused["message"], real
    refused = submitted(recorded, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "video_data": ["v.mp4"]})
    assert refused["param"] == "video_data"


def test_custom_params_are_accepted_as_sglang_types_them_and_custom_logit_processor_is_refused(recorded):
    slime = {"input_ids": [5], "sampling_params": {"top_p": 0.9, "custom_params": {"return_top_p_token_ids": True}}}
    assert submitted(recorded, "/generate", slime).top_p == 0.9
    flat = {"a": None, "b": [1, "x", 2.5], "c": {"d": False}}
    assert not isinstance(submitted(recorded, "/generate", {"input_ids": [5], "sampling_params": {"custom_params": flat}}), dict)
    for bad, param in (({"a": [[1]]}, "sampling_params.custom_params"), ("x", "sampling_params.custom_params")):
        refused = submitted(recorded, "/generate", {"input_ids": [5], "sampling_params": {"custom_params": bad}})
        assert refused["param"] == param, bad
    refused = submitted(recorded, "/generate", {"input_ids": [5], "custom_logit_processor": "{}"})
    assert refused["param"] == "custom_logit_processor"


def test_ignore_eos_drops_the_stop_token_ids_on_generate_and_keeps_them_on_vllm_routes(recorded):
    # SGLang's /generate: under ignore_eos no stop token ends the output (AReaL: EOS in stop_token_ids, fixed lengths)
    sampling = {"max_new_tokens": 8, "stop_token_ids": [2, 7], "ignore_eos": True}
    assert submitted(recorded, "/generate", {"input_ids": [5], "sampling_params": sampling}).stop_token_ids == ()
    assert submitted(recorded, "/generate", {"input_ids": [5], "sampling_params": {**sampling, "ignore_eos": False}}).stop_token_ids == (2, 7)
    # vLLM's: ignore_eos drops EOS alone (the tokenizer's finish rule); the request's stop ids still apply
    completion = {"prompt": [5], "max_tokens": 8, "stop_token_ids": [2, 7], "ignore_eos": True}
    assert submitted(recorded, "/v1/completions", completion).stop_token_ids == (2, 7)
    tokens = {"token_ids": [5], "sampling_params": {"max_tokens": 8, "stop_token_ids": [2, 7], "ignore_eos": True}}
    assert submitted(recorded, "/inference/v1/generate", tokens).stop_token_ids == (2, 7)


def test_vllm_tokens_route_reads_vllm_sampling_params(recorded):
    body = {"token_ids": [5, 6], "sampling_params": {"temperature": 0.5, "n": 1, "logprobs": 2, "seed": 3,
                                                     "include_stop_str_in_output": True, "min_tokens": 1}}
    sampling = submitted(recorded, "/inference/v1/generate", body)
    assert (sampling.max_new_tokens, sampling.temperature, sampling.top_logprobs, sampling.seed) == (16, 0.5, 2, 3)  # vLLM's 16
    assert sampling.no_stop_trim and sampling.min_new_tokens == 1 and sampling.prompt_logprobs_from == -1
    assert submitted(recorded, "/inference/v1/generate", {"token_ids": [5], "sampling_params": {"prompt_logprobs": 1}}).prompt_logprobs_from == 0
    for body, param in (({"token_ids": []}, "token_ids"), ({"token_ids": [5], "sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
                        ({"token_ids": [5], "sampling_params": {"logprobs": 21}}, "sampling_params.logprobs"),
                        ({"token_ids": [5], "features": "mm"}, "features"),
                        ({"token_ids": [5], "sampling_params": {"cache_salt": "x"}}, "sampling_params.cache_salt")):
        assert submitted(recorded, "/inference/v1/generate", body)["param"] == param, body
    client, _ = recorded
    assert client.post("/inference/v1/generate", json={"token_ids": [5], "model": "other"}).status_code == 404
