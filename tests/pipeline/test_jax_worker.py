"""The whole stack with the JAX worker and SmolLM2's real weights (`jaxstream up`, small step
buckets so it compiles quickly), driven by the official openai client and plain HTTP."""

import asyncio
import json

import httpx
import openai
import pytest

from tests.support import assert_idle, chat_prompt_ids, serve

pytestmark = pytest.mark.pipeline
MODEL = "SmolLM2-135M-Instruct"
SMALL = ("scheduler.max_tokens_per_step=64", "scheduler.max_running_requests=8", "scheduler.num_pages=256",
         "model.max_model_len=1024")
QUESTIONS = [
    "What is the capital of France?",
    "Name a color.",
    "Write two sentences about the moon and the tides.",
    "Explain in detail how a bicycle stays upright while moving, covering gyroscopic effects, trail, "
    "and the rider's steering corrections, then summarize it for a child.",
    "Count from one to ten in words.",
    "What is 2+2? Answer with one number, please.",
    "Give me a recipe for pancakes with a list of ingredients.",
    "Translate 'good morning' into French, Spanish and German.",
]


@pytest.fixture(scope="module")
def stack(redis_url):
    yield from serve(redis_url, *SMALL)


@pytest.fixture(autouse=True)
def idle_after_each_test(stack):
    yield
    assert_idle(stack)


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack + "/v1", api_key="unused", max_retries=0, timeout=120)


def worker_stats(base_url):
    return list(httpx.get(base_url + "/stats", timeout=5).json()["worker"].values())


def test_the_capital_of_france(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                       temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_min_tokens_holds_back_eos(client):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    short = client.chat.completions.create(model=MODEL, messages=question, temperature=0)
    held = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=40,
                                          extra_body={"min_tokens": 20})
    assert short.usage.completion_tokens < 20  # greedy would end (EOS) well before
    assert held.usage.completion_tokens >= 20
    assert held.choices[0].message.content.startswith(short.choices[0].message.content.rstrip("."))


def test_eight_concurrent_streams_give_each_the_tokens_it_gives_alone(stack, tokenizer_info):
    requests = [{"input_ids": chat_prompt_ids(tokenizer_info.tokenizer, q), "sampling_params": {"temperature": 0, "max_new_tokens": 8 + 5 * i}}
                for i, q in enumerate(QUESTIONS)]
    assert len({len(r["input_ids"]) for r in requests}) == 8  # prompts of different lengths
    alone = [httpx.post(stack + "/generate", json=body, timeout=120).json()["output_ids"] for body in requests]

    async def stream(http, body):
        last = None
        async with http.stream("POST", stack + "/generate", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = json.loads(line[6:])
        return last["output_ids"]

    async def together():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(stream(http, body) for body in requests))

    streamed = asyncio.run(together())
    for i, (a, s) in enumerate(zip(alone, streamed)):
        assert s == a, f"request {i}: {s} != {a}"


def test_seeded_sampling_is_reproducible_alone_and_in_a_busy_batch(client):
    def seeded():
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a story about a dragon."}],
            temperature=1.0, top_p=0.95, seed=2024, max_tokens=24,
        ).choices[0].message.content

    first, second = seeded(), seeded()
    assert first == second

    async def busy():
        aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0, timeout=120)
        others = [aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                                  temperature=0.8, max_tokens=20) for q in QUESTIONS[:6]]
        results = await asyncio.gather(*others[:3], asyncio.to_thread(seeded), *others[3:])
        return results[3]

    assert asyncio.run(busy()) == first
    different = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story about a dragon."}],
        temperature=1.0, top_p=0.95, seed=7, max_tokens=24,
    ).choices[0].message.content
    assert different != first


def test_nothing_compiles_after_start_up(stack, client, tokenizer_info):
    # A mixed workload: a prompt longer than the step budget (chunked), short and long outputs,
    # streaming and not, batched; then the worker's own count of compilations since it was ready.
    long_prompt = "Summarize this: " + " ".join(QUESTIONS * 3)

    async def mixed():
        aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0, timeout=120)
        calls = [aclient.completions.create(model=MODEL, prompt=long_prompt, max_tokens=5, temperature=0)]
        calls += [aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=3 + 4 * i,
                                                  temperature=0.5 * (i % 3), extra_body={"top_k": 40 if i % 2 else -1})
                  for i, q in enumerate(QUESTIONS)]
        await asyncio.gather(*calls)

    asyncio.run(mixed())
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    stats = worker_stats(stack)
    assert len(stats) == 1 and int(stats[0]["steps"]) > 0
    assert stats[0]["compiles_after_ready"] == "0", stats
