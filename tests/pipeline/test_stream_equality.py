"""Streaming changes nothing but the delivery: greedy, the same prompt gives the same text and the
same token ids streamed and not, on /v1/completions and /v1/chat/completions, with the JAX worker
on SmolLM2's real weights. Many prompts at once, so batches mix prefills, decodes and both kinds
of request (the ids come back as vLLM's return_tokens_as_token_ids logprob tokens)."""

import asyncio
import json

import httpx
import pytest

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
MODEL = "SmolLM2-135M-Instruct"
SUBJECTS = ["the sea", "a red bicycle", "Paris in winter", "prime numbers", "an old lighthouse", "coffee",
            "the moon landing", "a lost umbrella", "volcanoes", "jazz music", "a chess opening", "honeybees",
            "the number zero"]
TEMPLATES = ["Write one sentence about {}.", "Q: What do you know about {}?\nA:", "{} is", "List three facts about {}:"]
PROMPTS = [t.format(s) for s in SUBJECTS for t in TEMPLATES]  # 52
CONCURRENT = 12
COMMON = {"model": MODEL, "temperature": 0, "max_tokens": 12, "return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def stack(jax_stack):
    return jax_stack


def ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


async def events(http: httpx.AsyncClient, path: str, body: dict) -> list[dict]:
    async with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        lines = [line.removeprefix("data: ") async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


async def completion(http: httpx.AsyncClient, prompt: str, stream: bool) -> tuple[str, list[int], str]:
    body = {**COMMON, "prompt": prompt, "logprobs": 0, "stream": stream}
    if not stream:
        choice = (await http.post("/v1/completions", json=body)).json()["choices"][0]
        return choice["text"], ids(choice["logprobs"]["tokens"]), choice["finish_reason"]
    choices = [e["choices"][0] for e in await events(http, "/v1/completions", body)]
    return ("".join(c["text"] for c in choices), ids([t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]),
            choices[-1]["finish_reason"])


async def chat(http: httpx.AsyncClient, prompt: str, stream: bool) -> tuple[str, list[int], str]:
    body = {**COMMON, "messages": [{"role": "user", "content": prompt}], "logprobs": True, "stream": stream}
    if not stream:
        choice = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
        return choice["message"]["content"], ids([t["token"] for t in choice["logprobs"]["content"]]), choice["finish_reason"]
    choices = [e["choices"][0] for e in await events(http, "/v1/chat/completions", body)]
    return ("".join(c["delta"].get("content") or "" for c in choices),
            ids([t["token"] for c in choices if c.get("logprobs") for t in c["logprobs"]["content"]]),
            choices[-1]["finish_reason"])


def test_streamed_equals_plain_greedy(stack):
    async def run():
        limit = asyncio.Semaphore(CONCURRENT)

        async def one(route, prompt, stream):
            async with limit:
                return await route(http, prompt, stream)

        async with httpx.AsyncClient(base_url=stack, timeout=120) as http:
            jobs = [one(route, p, stream) for p in PROMPTS for route in (completion, chat) for stream in (False, True)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    assert len(PROMPTS) >= 50
    mismatches = []
    for i, prompt in enumerate(PROMPTS):
        for k, route in enumerate(("completions", "chat")):
            plain, streamed = results[4 * i + 2 * k], results[4 * i + 2 * k + 1]
            assert plain[1] and plain[2] in ("length", "stop"), (route, prompt, plain)
            if plain != streamed:
                mismatches.append((route, prompt, plain, streamed))
    assert not mismatches, mismatches
