"""SGLang's /v1/score on the JAX worker with SmolLM2's real weights: each score is the label's
next-token probability that /generate's prompt logprobs give for query + item + label.

Both run alone, from an empty prefix cache, on prompts of 9 to 15 tokens: the score's step (the
prompt) and /generate's (prompt + label) then share the 16-token step shape, so their layers'
float32 arithmetic is the same. Their heads are not: the score's runs on its one sampled row (on
CPU by the product kernel), /generate's prompt logprobs on the step's rows (XLA's product), each
summing in its own order: measured 5e-6 apart, relatively. Otherwise a prefix read from the cache
is attended in another summation order, and another step shape runs other matmul kernels: ~1e-5
apart."""

import math

import httpx
import numpy as np
import pytest

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]


@pytest.fixture(scope="module")
def stack(jax_stack):
    return jax_stack


def flushed(stack: str) -> str:
    assert httpx.post(stack + "/flush_cache", timeout=10).status_code == 200
    return stack


def label_logprobs(stack: str, prompt: list[int], labels: list[int]) -> list[float]:
    """/generate's prompt logprob of each label appended to the prompt (scored from the label's
    position, sampling nothing), each request alone."""
    assert 9 <= len(prompt) <= 15  # prompt and prompt + label in the 16-token step shape
    out = []
    for label in labels:
        body = {"input_ids": prompt + [label], "return_logprob": True, "logprob_start_len": len(prompt),
                "sampling_params": {"max_new_tokens": 0}}
        ((logprob, token, _),) = httpx.post(flushed(stack) + "/generate", json=body, timeout=120).json()["meta_info"]["input_token_logprobs"]
        assert token == label
        out.append(logprob)
    return out


def score(stack: str, **body) -> list[list[float]]:
    r = httpx.post(flushed(stack) + "/v1/score", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["scores"]


def test_scores_equal_generates_prompt_logprobs_of_each_label(stack):
    ids = lambda text: httpx.post(stack + "/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]  # noqa: E731
    labels = ids(" yes") + ids(" no") + ids(" Yes")
    query, items = "The capital of France is", [" Paris. Is that right? Answer:", " Berlin. Is that right? Answer:"]
    for item in items:  # texts joined, then tokenized, as SGLang
        (got,) = score(stack, query=query, items=item, label_token_ids=labels)
        np.testing.assert_allclose(got, np.exp(label_logprobs(stack, ids(query + item), labels)), rtol=2e-5)
    both = score(stack, query=query, items=items, label_token_ids=labels)  # one request per item, in one step
    np.testing.assert_allclose(both, [score(stack, query=query, items=[item], label_token_ids=labels)[0] for item in items], rtol=1e-4)
    # token ids joined as lists, item first; apply_softmax normalizes over the labels alone
    q, item = ids(" Is that right? Answer:"), ids("Berlin is the capital of France.")
    (soft,) = score(stack, query=q, items=[item], label_token_ids=labels, item_first=True, apply_softmax=True)
    p = np.exp(label_logprobs(stack, item + q, labels))
    np.testing.assert_allclose(soft, p / p.sum(), rtol=2e-5)
    assert math.isclose(sum(soft), 1.0, rel_tol=1e-9)


def test_vllm_prompt_logprobs_equal_generates_input_token_logprobs(stack):
    # The same prompt, the same step shape, from an empty prefix cache: the same numbers, and each
    # prompt token's rank is its place among its position's alternatives when it is one of them.
    prompt = httpx.post(stack + "/tokenize", json={"prompt": "The capital of France is Paris, and"}, timeout=30).json()["tokens"]
    body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    meta = httpx.post(flushed(stack) + "/generate", json=body, timeout=120).json()["meta_info"]
    r = httpx.post(flushed(stack) + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 5},
                   timeout=120).json()
    positions = r["choices"][0]["prompt_logprobs"]
    assert positions[0] is None and meta["input_token_logprobs"][0][0] is None and len(positions) == len(prompt)
    for position, (logprob, token, _), tops in zip(positions[1:], meta["input_token_logprobs"][1:], meta["input_top_logprobs"][1:]):
        assert position[str(token)]["logprob"] == logprob
        top_ids = [t for _, t, _ in tops]
        rank = position[str(token)]["rank"]
        assert rank == top_ids.index(token) + 1 if token in top_ids else rank > 5
        assert [position[str(t)]["logprob"] for t in top_ids] == [lp for lp, _, _ in tops]
