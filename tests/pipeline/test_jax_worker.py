"""The whole stack with the JAX worker and SmolLM2's real weights (`jaxstream up`, small step
buckets so it compiles quickly), driven by the official openai client and plain HTTP."""

import asyncio
import copy
import json
import math

import httpx
import numpy as np
import openai
import pytest

from tests.support import chat_prompt_ids

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
MODEL = "SmolLM2-135M-Instruct"
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
def stack(jax_stack):
    return jax_stack




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
    assert len(stats) == 1 and stats[0]["steps"] > 0
    assert stats[0]["compiles_after_ready"] == 0, stats


# -- logprobs and penalties against a float64 recomputation ------------------------------------


@pytest.fixture(scope="module")
def reference(hf_smollm2):
    """The same weights in transformers, in float64: logits [positions, V] of a whole sequence."""
    import torch

    model = copy.deepcopy(hf_smollm2).double()

    def logits(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].numpy()

    return logits


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_logprobs_are_the_temperature_scaled_full_vocabulary_ones(stack, tokenizer_info, reference):
    prompt = chat_prompt_ids(tokenizer_info.tokenizer, "Tell me a story about a dragon.")
    temperature = 0.7
    body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 12, "temperature": temperature, "top_k": 20, "seed": 11}}
    meta = httpx.post(stack + "/generate", json=body, timeout=120).json()["meta_info"]
    raw = httpx.post(stack + "/generate", json={**body, "logprobs_mode": "raw"}, timeout=120).json()["meta_info"]
    cut = httpx.post(stack + "/generate", json={**body, "logprobs_mode": "processed"}, timeout=120).json()["meta_info"]
    out = [e[1] for e in meta["output_token_logprobs"]]
    # the variant changes what is returned, not what is sampled
    assert [e[1] for e in raw["output_token_logprobs"]] == [e[1] for e in cut["output_token_logprobs"]] == out
    spelled = {**body["sampling_params"], "sampling_seed": 11}  # SGLang's /generate spelling of the seed
    del spelled["seed"]
    assert httpx.post(stack + "/generate", json={**body, "sampling_params": spelled}, timeout=120).json()["output_ids"] == out
    ref = reference(prompt + out)  # row p predicts position p + 1
    scaled, unscaled = log_softmax(ref / temperature), log_softmax(ref)
    top20 = np.argsort(-ref, axis=-1, kind="stable")[:, :20]
    kept = np.full_like(ref, -np.inf)
    np.put_along_axis(kept, top20, np.take_along_axis(ref / temperature, top20, axis=-1), axis=-1)
    processed = log_softmax(kept)  # top_k 20, renormalized
    n = len(prompt)
    for i, token in enumerate(out):
        assert meta["output_token_logprobs"][i][0] == pytest.approx(scaled[n - 1 + i, token], abs=1e-3)
        assert raw["output_token_logprobs"][i][0] == pytest.approx(unscaled[n - 1 + i, token], abs=1e-3)
        assert cut["output_token_logprobs"][i][0] == pytest.approx(processed[n - 1 + i, token], abs=1e-3)
        best = np.argsort(-scaled[n - 1 + i], kind="stable")[:3]
        assert [e[1] for e in meta["output_top_logprobs"][i]] == best.tolist()
        assert [e[1] for e in cut["output_top_logprobs"][i]] == best.tolist()  # the best 3 survive top-k 20
        assert [e[0] for e in meta["output_top_logprobs"][i]] == pytest.approx(scaled[n - 1 + i, best], abs=1e-3)
    inputs = meta["input_token_logprobs"]
    assert [e[1] for e in inputs] == prompt and inputs[0][0] is None
    assert [e[0] for e in inputs[1:]] == pytest.approx([scaled[q - 1, prompt[q]] for q in range(1, n)], abs=1e-3)

    def worst(got, want):
        return max(abs(g - w) for g, w in zip(got, want))

    print(f"{len(out)} sampled tokens (T={temperature}, top_k 20), {n - 1} prompt tokens; max |ours - float64 reference|:")
    print(f"  default logprobs {worst([e[0] for e in meta['output_token_logprobs']], [scaled[n - 1 + i, t] for i, t in enumerate(out)]):.2e}")
    print(f"  raw logprobs     {worst([e[0] for e in raw['output_token_logprobs']], [unscaled[n - 1 + i, t] for i, t in enumerate(out)]):.2e}")
    print(f"  processed        {worst([e[0] for e in cut['output_token_logprobs']], [processed[n - 1 + i, t] for i, t in enumerate(out)]):.2e}")
    print(f"  prompt logprobs  {worst([e[0] for e in inputs[1:]], [scaled[q - 1, prompt[q]] for q in range(1, n)]):.2e}")


def test_prefill_only_prompt_logprobs_are_those_of_a_request_that_samples(stack, tokenizer_info, reference):
    # SGLang's prefill-only request (max_new_tokens 0) scores a prompt chunked over several steps
    # (budget 64), without sampling; from logprob_start_len on, through a prefix cache hit.
    prompt = chat_prompt_ids(tokenizer_info.tokenizer, " ".join(QUESTIONS))
    assert len(prompt) > 2 * 64
    body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0}}

    def generate(**changes):
        out = httpx.post(stack + "/generate", json={**body, **changes}, timeout=120).json()
        return out, out["meta_info"]

    assert httpx.post(stack + "/flush_cache", timeout=30).status_code == 200
    _, sampled = generate()  # its whole pages stay in the prefix cache
    out, scored = generate(sampling_params={"max_new_tokens": 0})
    start = 70
    _, tail = generate(sampling_params={"max_new_tokens": 0}, logprob_start_len=start)
    assert out["output_ids"] == [] and out["text"] == "" and scored["output_token_logprobs"] == []
    assert scored["finish_reason"] == tail["finish_reason"] == {"type": "length", "length": 0}
    assert scored["completion_tokens"] == 0 and scored["cached_tokens"] == 0 and tail["cached_tokens"] == 64
    want = sampled["input_token_logprobs"]
    assert [e[1] for e in scored["input_token_logprobs"]] == [e[1] for e in want] == prompt
    assert [e[1] for e in tail["input_token_logprobs"]] == prompt[start:]
    assert scored["input_top_logprobs"] == sampled["input_top_logprobs"]
    assert scored["input_token_logprobs"][0][0] is None  # position 0: nothing predicts it
    got, expected = (np.array([e[0] for e in lps[1:]]) for lps in (scored["input_token_logprobs"], want))  # positions 1..
    cut = np.array([e[0] for e in tail["input_token_logprobs"]])  # positions start..
    assert np.array_equal(got, expected)  # the same steps: bit for bit
    assert np.allclose(cut, expected[start - 1:], rtol=0, atol=1e-5)  # other chunk boundaries: float32 rounding
    ref = log_softmax(reference(prompt))
    assert np.allclose(got, [ref[q - 1, prompt[q]] for q in range(1, len(prompt))], rtol=0, atol=1e-3)
    print(f"prefill-only vs sampling request: max |diff| {np.abs(got - expected).max():.1e}; "
          f"from position {start} after a cache hit: {np.abs(cut - expected[start - 1:]).max():.1e}")


def test_repetition_penalty_changes_greedy_tokens_as_the_reference_predicts(stack, tokenizer_info, reference):
    prompt = chat_prompt_ids(tokenizer_info.tokenizer, "Count from one to ten in words.")
    penalty = 1.5
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "repetition_penalty": penalty}}
    penalized = httpx.post(stack + "/generate", json=body, timeout=120).json()["output_ids"]
    plain = httpx.post(stack + "/generate", json={**body, "sampling_params": {"max_new_tokens": 16, "temperature": 0}},
                       timeout=120).json()["output_ids"]
    assert penalized != plain
    ref = reference(prompt + penalized)
    for i, token in enumerate(penalized):
        logits = ref[len(prompt) - 1 + i].copy()
        seen = list(set(prompt + penalized[:i]))
        logits[seen] = np.where(logits[seen] > 0, logits[seen] / penalty, logits[seen] * penalty)
        assert token == int(np.argmax(logits)), f"token {i}"


def test_logit_bias_forces_a_token(client, tokenizer_info):
    forced = tokenizer_info.tokenizer.encode(" banana")[0]
    r = client.completions.create(model=MODEL, prompt="My favourite fruit is", max_tokens=3, temperature=0,
                                  logit_bias={str(forced): 100}, logprobs=1)
    assert r.choices[0].logprobs.tokens == [" banana"] * 3


def test_allowed_token_ids_sample_only_those_and_logprobs_are_over_them(client, tokenizer_info):
    # vLLM's allowed_token_ids: every other token as if biased by -inf, so the default logprobs'
    # distribution is over the allowed ids alone: its three alternatives' probabilities sum to 1.
    allowed = [tokenizer_info.tokenizer.encode(word)[0] for word in (" Paris", " London", " Rome")]
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=3,
                                  extra_body={"allowed_token_ids": allowed, "return_tokens_as_token_ids": True})
    tokens = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
    assert len(tokens) == 4 and set(tokens) <= set(allowed) and tokens[0] == allowed[0]
    for alternatives in r.choices[0].logprobs.top_logprobs:
        assert {int(t.removeprefix("token_id:")) for t in alternatives} == set(allowed)
        assert abs(sum(math.exp(lp) for lp in alternatives.values()) - 1) < 1e-4


def test_streamed_multibyte_text_has_no_replacement_character(client):
    question = [{"role": "user", "content": "Show me three emoji."}]
    whole = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=30).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=question, temperature=0, max_tokens=30, stream=True) if c.choices]
    assert any(ord(ch) > 0xFFFF for ch in whole)  # 4-byte characters, each split over several tokens
    assert "\ufffd" not in "".join(pieces) and "".join(pieces) == whole


def test_model_info_names_the_architecture_the_worker_loaded(stack):
    info = httpx.get(stack + "/get_model_info", timeout=10).json()
    assert info["architectures"] == ["LlamaForCausalLM"] and info["model_type"] == "llama"
    assert info["max_model_len"] == 1024 and info["vocab_size"] == 49152


def test_the_pool_is_the_memory_it_was_given_over_the_bytes_per_token_the_worker_reports(stack):
    """SMALL_JAX gives the pool as scheduler.kv_cache_memory_gib: SmolLM2 caches 30 layers x (k, v) x 3 KV
    heads x 64 float32 numbers a token, and the scheduler's pool is the worker's, 256 pages of 16."""
    info = httpx.get(stack + "/get_server_info", timeout=10).json()
    assert info["kv_bytes_per_token"] == worker_stats(stack)[0]["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    assert info["max_total_num_tokens"] == info["internal_states"][0]["max_total_tokens"] == 256 * 16
    assert info["config"]["scheduler"]["num_pages"] == info["vllm_config"]["cache_config"]["num_gpu_blocks"] == 256


def test_output_token_logprobs_cover_every_generated_token_eos_included(stack, tokenizer_info):
    body = {"input_ids": chat_prompt_ids(tokenizer_info.tokenizer, "What is the capital of France?"), "return_logprob": True,
            "sampling_params": {"max_new_tokens": 64, "temperature": 0}}
    out = httpx.post(stack + "/generate", json=body, timeout=120).json()
    meta = out["meta_info"]
    eos = tokenizer_info.eos_token_ids[0]
    assert meta["finish_reason"] == {"type": "stop", "matched": eos} and out["output_ids"][-1] == eos
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert len(out["output_ids"]) == meta["completion_tokens"] and "Paris" in out["text"]


def test_a_prefix_cache_hit_gives_the_greedy_answer_of_a_full_prefill(stack, tokenizer_info):
    prompt = chat_prompt_ids(tokenizer_info.tokenizer, QUESTIONS[3])  # the longest question: a few whole pages
    bodies = [{"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0, **extra}}
              for extra in ({}, {"repetition_penalty": 1.3})]  # the penalty counts the prefix it was not fed

    def generate(body):
        out = httpx.post(stack + "/generate", json=body, timeout=120).json()
        return out["output_ids"], out["meta_info"]["cached_tokens"]

    assert httpx.post(stack + "/flush_cache", timeout=30).status_code == 200
    cold = generate(bodies[0])
    hits = [generate(body) for body in bodies]  # the second identical prompt, then the penalized one
    assert httpx.post(stack + "/flush_cache", timeout=30).status_code == 200
    penalized_cold = generate(bodies[1])
    assert cold[1] == 0 and penalized_cold[1] == 0
    assert all(cached > 0 for _, cached in hits), hits
    assert hits[0][0] == cold[0] and hits[1][0] == penalized_cold[0]
    assert cold[0] != penalized_cold[0]  # the penalty really changes the answer
