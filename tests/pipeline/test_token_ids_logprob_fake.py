"""SGLang's token_ids_logprob on /generate and its /v1/score, on the whole pipeline with the fake
worker (every id i has logprob lp(i) = -(i % 10) / 10 at every position: worker_svc/fake.py)."""

import math

import httpx
import pytest

from tests.support import generate_then_abort

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]


@pytest.fixture(scope="module")
def stack(fake_stack):
    return fake_stack


def lp(token: int) -> float:
    return -(token % 10) / 10


def test_generate_returns_each_positions_logprobs_of_the_asked_ids(stack, tokenizer_info):
    body = {"input_ids": [10, 20, 30], "return_logprob": True, "logprob_start_len": 0, "return_text_in_logprobs": True,
            "token_ids_logprob": [13, 4, 13, 99], "sampling_params": {"max_new_tokens": 2}}
    meta = httpx.post(stack + "/generate", json=body, timeout=30).json()["meta_info"]
    asked = [13, 4, 99]  # repeats dropped, order kept
    texts = [tokenizer_info.tokenizer.decode([i]) for i in asked]
    assert [[e[1] for e in row] for row in meta["output_token_ids_logprobs"]] == [asked, asked]
    assert [[e[2] for e in row] for row in meta["output_token_ids_logprobs"]] == [texts, texts]
    assert [[e[0] for e in row] for row in meta["output_token_ids_logprobs"]] == [pytest.approx([lp(i) for i in asked])] * 2
    # per prompt position; the first has no predictor: null, as SGLang
    inputs = meta["input_token_ids_logprobs"]
    assert len(inputs) == 3 and inputs[0] is None
    assert [[e[1] for e in row] for row in inputs[1:]] == [asked, asked]
    assert [[e[0] for e in row] for row in inputs[1:]] == [pytest.approx([lp(i) for i in asked])] * 2
    # without return_logprob nothing comes back (SGLang reads it only then); without the ids, no such field
    plain = httpx.post(stack + "/generate", json={**body, "return_logprob": False}, timeout=30).json()["meta_info"]
    assert "output_token_ids_logprobs" not in plain
    none = httpx.post(stack + "/generate", json={**body, "token_ids_logprob": None}, timeout=30).json()["meta_info"]
    assert "output_token_ids_logprobs" not in none and "input_token_ids_logprobs" not in none


def test_an_aborted_request_returns_the_ids_logprobs_of_its_partial_output(stack):
    meta = generate_then_abort(stack, "ids-abort", after=3, token_ids_logprob=[7, 8])["meta_info"]
    assert len(meta["output_token_ids_logprobs"]) == meta["completion_tokens"] >= 3
    assert all([e[1] for e in row] == [7, 8] for row in meta["output_token_ids_logprobs"])


@pytest.mark.parametrize("value, says", [
    ("13", "must be an array"),
    ([1, -2], "must be a list of token ids"),
    ([[1, 2]], "must be a list of token ids"),
    (list(range(65)), "at most 64 distinct token ids, got 65"),
    ([5, 49152], "token id 49152 is out of vocabulary"),  # the tokenizer's check
])
def test_generate_refuses_bad_token_ids_logprob_naming_the_field(stack, value, says):
    body = {"input_ids": [1, 2], "return_logprob": True, "token_ids_logprob": value, "sampling_params": {"max_new_tokens": 1}}
    r = httpx.post(stack + "/generate", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "token_ids_logprob" and says in r.json()["error"]["message"]


def test_score_gives_each_items_label_probabilities_in_label_order(stack):
    labels = [13, 4, 13]  # a repeat scores again
    body = {"query": "Is it", "items": [" yes", " no"], "label_token_ids": labels, "model": "mine"}
    out = httpx.post(stack + "/v1/score", json=body, timeout=30).json()
    assert out["object"] == "scoring" and out["model"] == "mine" and len(out["scores"]) == 2
    assert out["scores"] == [pytest.approx([math.exp(lp(i)) for i in labels])] * 2
    soft = httpx.post(stack + "/v1/score", json={**body, "apply_softmax": True, "items": " yes", "item_first": True}, timeout=30).json()
    (row,) = soft["scores"]
    weights = [math.exp(lp(i)) for i in labels]
    assert row == pytest.approx([w / sum(weights) for w in weights]) and sum(row) == pytest.approx(1.0)
    ids = httpx.post(stack + "/v1/score", json={"query": [1, 2], "items": [[3], [4, 5]], "label_token_ids": [9]}, timeout=30).json()
    assert ids["scores"] == [[pytest.approx(math.exp(lp(9)))]] * 2 and ids["model"]


@pytest.mark.parametrize("body, param, says", [
    ({"query": "q", "items": [], "label_token_ids": [1]}, "items", "must not be empty"),
    ({"query": "q", "items": [[1, 2]], "label_token_ids": [1]}, "items", "both text or both token ids"),
    ({"query": [1, 2], "items": ["a"], "label_token_ids": [1]}, "items", "both text or both token ids"),
    ({"query": [1, "x"], "items": [[1]], "label_token_ids": [1]}, "query", "list of token ids"),
    ({"query": [1], "items": [[1, -1]], "label_token_ids": [1]}, "items[0]", "list of token ids"),
    ({"items": ["a"], "label_token_ids": [1]}, "query", "must be given"),
    ({"query": "q", "items": ["a"]}, "label_token_ids", "must be given"),
    ({"query": "q", "items": ["a"], "label_token_ids": []}, "label_token_ids", "at least one"),
    ({"query": "q", "items": ["a"], "label_token_ids": ["1"]}, "label_token_ids", "list of token ids"),
    ({"query": "q", "items": ["a"], "label_token_ids": [49152]}, "label_token_ids", "out of vocabulary"),
    ({"query": "", "items": [""], "label_token_ids": [1]}, "items", "cannot be empty"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1], "apply_softmax": "yes"}, "apply_softmax", "must be a boolean"),
])
def test_score_refuses_bad_input_naming_the_field(stack, body, param, says):
    r = httpx.post(stack + "/v1/score", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and says in r.json()["error"]["message"], r.json()


def test_a_batch_names_each_prompts_own_ids(stack):
    # SGLang's io_struct.py, GenerateReqInput._normalize_logprob_params: a list of lists, one per prompt
    body = {"input_ids": [[10, 20], [30]], "return_logprob": True, "token_ids_logprob": [[7, 8], [9, 7, 9]],
            "sampling_params": {"max_new_tokens": 1}}
    first, second = httpx.post(stack + "/generate", json=body, timeout=30).json()
    assert [[e[1] for e in row] for row in first["meta_info"]["output_token_ids_logprobs"]] == [[7, 8]]
    assert [[e[0] for e in row] for row in second["meta_info"]["output_token_ids_logprobs"]] == [pytest.approx([lp(9), lp(7)])]
    for bad, says in (({"token_ids_logprob": [[7]]}, "gives 1 list of ids for 2 prompts: one per prompt"),
                      ({"sampling_params": {"max_new_tokens": 1, "n": 2}}, "Cannot use list token_ids_logprob with parallel_sample_num > 1")):
        r = httpx.post(stack + "/generate", json={**body, **bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "token_ids_logprob", r.text
        assert says in r.json()["error"]["message"]
