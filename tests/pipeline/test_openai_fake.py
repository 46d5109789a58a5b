"""The whole stack (`jaxstream up worker=fake`) on a real Redis, driven by the official openai client
and plain HTTP. The fake worker continues a prompt whose last token is t with t+1, t+2, ...
"""

import asyncio
import json

import httpx
import openai
import pytest

from tests.support import chat_prompt_ids

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def stack(fake_stack):
    return fake_stack




def continuation(last: int, n: int, vocab: int) -> list[int]:
    return [(last + i) % vocab for i in range(1, n + 1)]


def expected_text(tok, ids: list[int]) -> str:
    return tok.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_completion(client, tokenizer_info):
    prompt = "The quick brown fox"
    ids = tokenizer_info.tokenizer.encode(prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6)
    assert r.choices[0].text == expected_text(tokenizer_info, continuation(ids[-1], 6, tokenizer_info.vocab_size))
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 6, len(ids) + 6)
    assert r.object == "text_completion" and r.model == MODEL


def test_completion_stream(client, tokenizer_info):
    ids = [1000, 2000, 3000]
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text(tokenizer_info, continuation(3000, 8, tokenizer_info.vocab_size))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])


def test_chat(client, tokenizer_info):
    ids = chat_prompt_ids(tokenizer_info.tokenizer, "What is the capital of France?")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                       max_tokens=5, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected_text(tokenizer_info, continuation(ids[-1], 5, tokenizer_info.vocab_size))
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 5)


def test_chat_stream(client, tokenizer_info):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    text = tokenizer_info.tokenizer.apply_chat_template(messages[:1] + [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    ids = tokenizer_info.tokenizer.encode(text, add_special_tokens=False)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == expected_text(tokenizer_info, continuation(ids[-1], 7, tokenizer_info.vocab_size))
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
    assert all(c.usage is None for c in chunks)  # no usage unless asked


def test_stop_token_id(client, tokenizer_info):
    ids = [500, 600, 700]
    cont = continuation(700, 3, tokenizer_info.vocab_size)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=50, extra_body={"stop_token_ids": [cont[-1]]})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 3
    assert r.choices[0].text == expected_text(tokenizer_info, cont)


def test_stop_string_ends_request_and_frees_pages(client, tokenizer_info):
    ids = [4000, 5000, 6000]
    cont = continuation(6000, 12, tokenizer_info.vocab_size)
    full = expected_text(tokenizer_info, cont)
    stop = expected_text(tokenizer_info, [cont[5]]).strip()
    assert stop and stop in full
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=500, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]
    # the scheduler was told: nothing keeps running to max_tokens (the autouse idle check)


def test_native_generate(stack, tokenizer_info):
    body = {"input_ids": [10, 20, 30], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    r = httpx.post(stack + "/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == [31, 32, 33, 34]
    assert out["text"] == expected_text(tokenizer_info, [31, 32, 33, 34])
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (3, 4)


def spec_counts(stack) -> tuple[int, int]:
    (stats,) = httpx.get(stack + "/stats", timeout=10).json()["scheduler"].values()
    return stats["spec_decode_num_draft_tokens_total"], stats["spec_decode_num_accepted_tokens_total"]


def test_ngram_drafts_verify_several_tokens_a_step_and_change_no_output(stack, client, tokenizer_info):
    """The fake stack drafts (scheduler.speculative=ngram): a prompt holding the run the fake model
    counts up gets drafts from it, accepted up to where the prompt's run broke off. The output is
    the fake's arithmetic, streamed or not, and /stats and /metrics count the drafts."""
    # After 1003 (the prefill's token), [1002, 1003] drafts [1004, 1005, 1006, 1007]: all accepted
    prompt = [1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007, 1000, 1001, 1002]
    want = continuation(1002, 12, tokenizer_info.vocab_size)
    drafted, accepted = spec_counts(stack)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, logprobs=1, extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected_text(tokenizer_info, want)
    assert r.choices[0].logprobs.tokens and len(r.choices[0].logprobs.token_logprobs) == 12
    after = spec_counts(stack)
    assert after[0] - drafted >= 4 and after[1] - accepted >= 4, (drafted, accepted, after)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    metrics = httpx.get(stack + "/metrics", timeout=10).text
    assert "jaxstream:spec_decode_num_accepted_tokens_total{" in metrics and "jaxstream:spec_decode_acceptance_rate{" in metrics


def test_native_generate_stream_is_cumulative(stack, tokenizer_info):
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 5}, "stream": True}
    with httpx.stream("POST", stack + "/generate", json=body, timeout=30) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    texts = [p["text"] for p in payloads]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert payloads[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(payloads[-1]["output_ids"]) == 5


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "", "max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": [49152], "max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": [-1], "max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": [7] * 8192, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": [7] * 8000, "max_tokens": 500}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),  # any role goes to the template (as vLLM)
    ("/generate", {"sampling_params": {"max_new_tokens": 3}}, 400, "text"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": -5}}, 400, "sampling_params.top_k"),
    # min_tokens holds stop tokens back on the device, at most 16 of them (EOS included)
    ("/v1/completions", {"prompt": "hi", "min_tokens": 2, "stop_token_ids": list(range(100, 116))}, 400, "stop_token_ids"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(stack, path, body, status, param):
    r = httpx.post(stack + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert error["code"] is None or isinstance(error["code"], str)  # OpenAI's: never the HTTP status
    assert httpx.get(stack + "/health", timeout=5).status_code == 200


# OpenAI's error.code where OpenAI has one, else null; messages name a JSON kind with its article
ERROR_CODES = [
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, "model_not_found", "The model `gpt-4` does not exist."),
    ("/v1/completions", {"prompt": [7] * 8192, "max_tokens": 1}, "context_length_exceeded", "your request has 8192 input tokens"),
    ("/v1/completions", {"prompt": [7] * 8191, "max_tokens": 2}, "context_length_exceeded", "your request has 8191 input tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "invalid_type", "'max_tokens' must be an integer, got a string"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": 5}}, "invalid_type", "must be a string or an array, got an integer"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, None, "temperature"),
    # max_tokens 0 scores a prompt only where the API says so: /generate, completions with echo (as vLLM)
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, None, "'sampling_params.max_new_tokens' must be >= 0, got -1"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, None, "'max_tokens' must be >= 1, got 0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, None, "'max_tokens' must be >= 1, got 0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "x": "secret"}]},
     None, "'tools[0].function' is required"),
]


@pytest.mark.parametrize("path,body,code,message", ERROR_CODES)
def test_error_codes_are_openais(stack, path, body, code, message):
    error = httpx.post(stack + path, json=body, timeout=30).json()["error"]
    assert error["code"] == code and message in error["message"], error
    assert "secret" not in error["message"]  # a refusal never echoes the client's value


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe\x00", b"[1, 2]"])
def test_malformed_bodies(stack, raw):
    r = httpx.post(stack + "/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_sees_errors_and_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="", max_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=3)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_disconnect_storm_frees_every_page(stack, tokenizer_info):
    """200 streaming requests, 50 of them dropped mid-stream: the rest complete, nothing leaks."""
    vocab = tokenizer_info.vocab_size

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str | None]:
        leave = i % 4 == 0
        body = {"prompt": [100 + i], "max_tokens": 4000 if leave else 24, "stream": True, "ignore_eos": True}
        text, chunks = "", 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks += 1
                text += json.loads(line[6:])["choices"][0]["text"]
                if leave and chunks == 2:
                    return i, None  # leaving the block closes the connection mid-stream
        return i, text

    async def storm() -> list[tuple[int, str | None]]:
        async with httpx.AsyncClient(base_url=stack, timeout=120, limits=httpx.Limits(max_connections=250)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    results = asyncio.run(storm())
    finished = [(i, text) for i, text in results if text is not None]
    assert len(finished) == 150
    for i, text in finished:
        assert text == expected_text(tokenizer_info, continuation(100 + i, 24, vocab))
    # the autouse fixture then asserts: nothing running or waiting, zero pages in use


def test_non_streaming_client_timeout_aborts(stack, client):
    impatient = openai.OpenAI(base_url=stack + "/v1", api_key="unused", max_retries=0, timeout=0.5)
    for _ in range(5):
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model=MODEL, prompt="hi", max_tokens=8000, extra_body={"ignore_eos": True})
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens == 3


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/no-such-route", 404), ("GET", "/v1/completions", 405)])
def test_unknown_routes_and_methods_get_openai_errors(stack, method, path, status):
    r = httpx.request(method, stack + path, timeout=10)
    assert r.status_code == status and r.json()["error"]["message"]
