"""Routed experts export through the whole stack (`worker.enable_return_routed_experts=true`, the
tiny random Qwen3-MoE: layer 0 MoE, layer 1 dense): SGLang's request fields and response shape on
/generate and the OpenAI routes, the row count (prompt + completion - 1 - start_len) for a request
ended by max_new_tokens and for an aborted one, the rows of a prefix-cache hit, and the 400s (a
dense model's: tests/unit/test_fake_worker.py, from the facts the fake worker reports).
Which experts they are is checked against transformers in tests/model/test_routed_experts.py; here
against the same random weights run in-process by the driver."""

import base64
import json

import httpx
import numpy as np
import pytest

from jaxstream.config import load_config
from jaxstream.protocol import SamplingParams
from tests.support import generate_then_abort, serve
from tests.worker.driver import Driver
from worker_svc.start import build_engine

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]

SMALL = ["model=qwen3_moe_tiny", "worker.token_buckets=[4,16]", "worker.pair_buckets=[0,16,64]", "scheduler.max_running_requests=4",
         "scheduler.max_tokens_per_step=16", "scheduler.num_pages=64", "model.max_model_len=256"]
PROMPT = [(7 * i + 3) % 500 for i in range(40)]  # over two pages of 16: a second request hits the cache
LAYERS, TOP_K = 2, 2


@pytest.fixture(scope="module")
def stack(redis_url):
    yield from serve(redis_url, *SMALL, "worker.enable_return_routed_experts=true")


def generate(base_url: str, **body) -> httpx.Response:
    return httpx.post(base_url + "/generate", json=body, timeout=60)


def rows_of(fields: dict) -> np.ndarray:
    assert fields["routed_experts_dtype"] == "int32"
    return np.frombuffer(base64.b64decode(fields["routed_experts"]), "<i4").reshape(fields["routed_experts_shape"])


def test_generate_returns_every_row_that_ran_as_the_engine_computes_them(stack):
    sampling = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    meta = generate(stack, input_ids=PROMPT, sampling_params=sampling, return_routed_experts=True).json()["meta_info"]
    rows = rows_of(meta)
    assert rows.shape == (len(PROMPT) + 5 - 1, LAYERS, TOP_K) and meta["routed_experts_start_len"] == 0
    assert not rows[:, 1].any() and ((0 <= rows[:, 0]) & (rows[:, 0] < 8)).all()  # layer 1 is dense: 0s
    # The same random weights (worker.seed), in-process, with the same greedy tokens.
    engine = build_engine(load_config([*SMALL, "worker.enable_return_routed_experts=true"]), progress=False)
    asks = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True, return_routed_experts=True)
    trace = Driver(engine, 16, 64, budget=16, max_running=4).run([("r", PROMPT, asks)])["r"]
    np.testing.assert_array_equal(rows, np.concatenate([np.frombuffer(e.ids.data, "<i4").reshape(e.ids.shape) for e in trace.experts]))

    # A second identical request, from position 7: its prompt's first pages come from the prefix
    # cache, and it reports their rows all the same.
    again = generate(stack, input_ids=PROMPT, sampling_params=sampling, return_routed_experts=True, routed_experts_start_len=7).json()
    assert again["meta_info"]["cached_tokens"] >= 16
    assert again["meta_info"]["routed_experts_shape"] == [len(PROMPT) + 5 - 1 - 7, LAYERS, TOP_K]
    np.testing.assert_array_equal(rows_of(again["meta_info"]), rows[7:])
    plain = generate(stack, input_ids=PROMPT, sampling_params=sampling).json()["meta_info"]
    assert "routed_experts" not in plain


def test_an_aborted_stream_carries_the_rows_of_what_ran(stack):
    meta = generate_then_abort(stack, "r3-abort", after=3, input_ids=[5, 6, 7], return_routed_experts=True,
                               sampling_params={"max_new_tokens": 200, "ignore_eos": True})["meta_info"]
    assert meta["routed_experts_shape"] == [3 + meta["completion_tokens"] - 1, LAYERS, TOP_K]


def test_openai_routes_return_them_in_sglext(stack):
    completion = httpx.post(stack + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                                             "return_routed_experts": True, "routed_experts_start_len": 2}, timeout=60).json()
    assert rows_of(completion["sglext"]).shape == (len(PROMPT) + 3 - 1 - 2, LAYERS, TOP_K)
    chat = httpx.post(stack + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                                            "return_routed_experts": True, "n": 2}, timeout=60).json()
    for choice in chat["choices"]:  # several choices: each its own
        assert rows_of(choice["sglext"]).shape == (chat["usage"]["prompt_tokens"] + 2 - 1, LAYERS, TOP_K)
    chunks = httpx.post(stack + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": True,
                                                         "return_routed_experts": True}, timeout=60).text
    events = [json.loads(line[6:]) for line in chunks.splitlines() if line.startswith("data: {")]
    assert [("sglext" in e) for e in events] == [False] * (len(events) - 1) + [True]
    assert rows_of(events[-1]["sglext"]).shape == (len(PROMPT) + 2 - 1, LAYERS, TOP_K)


@pytest.mark.parametrize("start, message", [(41, "routed_experts_start_len 41 must be within [0, prompt tokens]"),
                                            (-1, "'routed_experts_start_len' must be within [0, prompt tokens], got -1")])
def test_a_start_len_outside_the_prompt_is_a_400(stack, start, message):
    response = generate(stack, input_ids=PROMPT, return_routed_experts=True, routed_experts_start_len=start)
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == "routed_experts_start_len" and error["type"] == "invalid_request_error"


def test_the_switch_off_is_a_400_naming_it(fake_stack):
    for path, body in (("/generate", {"text": "hi"}), ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        response = httpx.post(fake_stack + path, json={**body, "return_routed_experts": True}, timeout=30)
        assert response.status_code == 400, path
        assert "worker.enable_return_routed_experts=true" in response.json()["error"]["message"]
