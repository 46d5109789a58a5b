"""vLLM's whole-vocabulary logprobs (-1) under `server.max_logprobs=-1`, through the whole fake
stack: every token of the vocabulary comes back, sampled token first (vLLM's order), and a count
past the vocabulary is refused in vLLM's words. The fake worker gives alternatives next, next + 1,
... (mod the vocabulary) of any count (worker_svc/fake.py)."""

import httpx
import pytest

from tests.support import serve

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152  # SmolLM2's tokenizer


@pytest.fixture(scope="module")
def stack(redis_url):
    yield from serve(redis_url, "worker=fake", "server.max_logprobs=-1")


def ids(entries) -> list[int]:
    return [int(token.removeprefix("token_id:")) for token in entries]


def test_minus_one_returns_every_tokens_logprob(stack):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True, "top_logprobs": -1,
            "return_tokens_as_token_ids": True}
    (entry,) = httpx.post(stack + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]["content"]
    alternatives = ids(a["token"] for a in entry["top_logprobs"])
    assert sorted(alternatives) == list(range(VOCAB)) and alternatives[0] == ids([entry["token"]])[0]
    prompt = {"model": MODEL, "prompt": [10, 20], "max_tokens": 1, "prompt_logprobs": -1}
    scored = httpx.post(stack + "/v1/completions", json=prompt, timeout=60).json()["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and sorted(map(int, scored[1])) == list(range(VOCAB))
    r = httpx.post(stack + "/v1/chat/completions", json={**body, "top_logprobs": VOCAB + 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        f"Requested sample logprobs of {VOCAB + 1}, which is greater than max allowed: {VOCAB}")
