"""vLLM's request extensions on the OpenAI routes, through the whole fake stack with the official
client: prompt_logprobs, return_token_ids, continuous usage, truncate_prompt_tokens, chat echo and
continuation (SGLang's assistant prefill), and the peers' fields we refuse rather than ignore.
The fake worker continues a prompt whose last token is t with t+1, t+2, ... (worker_svc/fake.py)."""

import httpx
import openai
import pytest

from tests.support import chat_prompt_ids

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
MODEL = "SmolLM2-135M-Instruct"
SAYING = [{"role": "user", "content": "Tell me a saying"}, {"role": "assistant", "content": "An apple a day"}]


@pytest.fixture(scope="module")
def stack(fake_stack):
    return fake_stack


def post(stack: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(stack + path, json={"model": MODEL, **body}, timeout=60)


def test_return_token_ids_on_completions_plain_and_streamed(client):
    ids = [1000, 2000, 3000]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, extra_body={"return_token_ids": True})
    assert r.choices[0].prompt_token_ids == ids and r.choices[0].token_ids == [3001, 3002, 3003, 3004]
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=4).model_dump()["choices"][0]
    assert plain["prompt_token_ids"] is None and plain["token_ids"] is None and plain["prompt_logprobs"] is None  # keys always there
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=4, stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].prompt_token_ids == ids
    assert all("prompt_token_ids" not in c.choices[0].model_dump() for c in chunks[1:])
    assert sum((c.choices[0].token_ids for c in chunks), []) == [3001, 3002, 3003, 3004]


def test_return_token_ids_on_chat_plain_and_streamed(client, tokenizer_info):
    messages = [{"role": "user", "content": "Hi there"}]
    prompt = chat_prompt_ids(tokenizer_info.tokenizer, "Hi there")
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, extra_body={"return_token_ids": True})
    assert r.prompt_token_ids == prompt and r.choices[0].token_ids == [prompt[-1] + i for i in (1, 2, 3)]
    without = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    assert without.prompt_token_ids is None and without.choices[0].token_ids is None
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, stream=True,
                                                 extra_body={"return_token_ids": True}))
    assert chunks[0].prompt_token_ids == prompt
    assert all("prompt_token_ids" not in c.model_dump() for c in chunks[1:])
    assert sum((c.choices[0].model_dump().get("token_ids") or [] for c in chunks), []) == [prompt[-1] + i for i in (1, 2, 3)]


def test_prompt_logprobs_on_completions_and_chat(client, tokenizer_info):
    ids = [1000, 2000, 3007]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, extra_body={"prompt_logprobs": 2})
    positions = r.choices[0].prompt_logprobs
    assert positions[0] is None and len(positions) == 3
    # The fake: position q's token t has logprob -(t % 10) / 10; alternatives after token a are a+1, a+2.
    assert positions[2]["3007"]["logprob"] == pytest.approx(-0.7)
    assert positions[2]["3007"]["rank"] == 3007 - 2000  # the fake ranks t after a at (t - a - 1) % vocab + 1
    assert positions[2]["2001"] == {"logprob": pytest.approx(-0.1), "rank": 1, "decoded_token": tokenizer_info.tokenizer.decode([2001])}
    assert positions[2]["2002"]["rank"] == 2 and len(positions[2]) == 3
    assert positions[1]["2000"]["decoded_token"] == tokenizer_info.tokenizer.decode([2000])
    assert r.choices[0].logprobs is None  # only the prompt's were asked
    two = client.completions.create(model=MODEL, prompt=["a b", "c d e"], max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert [len(c.prompt_logprobs) for c in two.choices] == [len(tokenizer_info.tokenizer.encode(t)) for t in ("a b", "c d e")]
    assert all(len(p) == 1 for c in two.choices for p in c.prompt_logprobs[1:])  # the prompt's token alone
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 1})
    assert chat.prompt_logprobs[0] is None and len(chat.prompt_logprobs) == len(chat_prompt_ids(tokenizer_info.tokenizer, "Hi"))
    for bad in (-1, 21):
        with pytest.raises(openai.BadRequestError, match="prompt logprobs"):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"prompt_logprobs": bad})


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_continuous_usage_in_every_chunk_only_with_include_usage(client, route):
    def stream(n: int = 1, extra_body: dict | None = None, **options):
        extra = {"n": n, "extra_body": extra_body}
        if route == "completions":
            return list(client.completions.create(model=MODEL, prompt=[1005, 1006], max_tokens=4, stream=True, stream_options=options, **extra))
        return list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                                   stream=True, stream_options=options, **extra))

    chunks = stream(include_usage=True, continuous_usage_stats=True)
    assert all(c.usage is not None and c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].finish_reason] == [4]
    assert all(c.usage is None for c in stream(include_usage=False, continuous_usage_stats=True))
    # vLLM's counting: each chunk counts its own choice's tokens up to and including its own (chat's
    # role chunk none), and the last token's text comes in the chunk that carries the finish_reason.
    chunks = stream(include_usage=True, continuous_usage_stats=True, n=2, extra_body={"return_token_ids": True})
    counted = {0: 0, 1: 0}
    for c in chunks[:-1]:
        (choice,) = c.choices
        counted[choice.index] += len(choice.model_dump().get("token_ids") or [])
        assert c.usage.completion_tokens == counted[choice.index] and c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens
        if choice.finish_reason:
            assert choice.model_dump().get("token_ids") and (choice.text if route == "completions" else choice.delta.content)
    assert counted == {0: 4, 1: 4} and chunks[-1].usage.completion_tokens == 8
    if route == "chat":
        assert [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].delta.role] == [0, 0]


def test_truncate_prompt_tokens_keeps_the_prompts_end(client):
    r = client.completions.create(model=MODEL, prompt=list(range(100, 120)), max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": 5, "return_token_ids": True})
    assert r.choices[0].prompt_token_ids == list(range(115, 120)) and r.usage.prompt_tokens == 5
    right = client.completions.create(model=MODEL, prompt=list(range(100, 120)), max_tokens=2,
                                      extra_body={"truncate_prompt_tokens": 5, "truncation_side": "right", "return_token_ids": True})
    assert right.choices[0].prompt_token_ids == list(range(100, 105)) and right.choices[0].token_ids == [105, 106]
    with pytest.raises(openai.BadRequestError, match="truncation_side"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"truncate_prompt_tokens": 1, "truncation_side": "middle"})
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a long question " * 5}], max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3
    for bad in (0, -2):
        with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"truncate_prompt_tokens": bad})
    with pytest.raises(openai.BadRequestError, match="greater than max_model_len"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"truncate_prompt_tokens": 10**6})


def test_a_final_assistant_message_is_continued_and_echoed(stack, client, tokenizer_info):
    tok = tokenizer_info.tokenizer
    open_turn = tok.apply_chat_template(SAYING, add_generation_prompt=False, continue_final_message=True, tokenize=False)
    prompt = tok.encode(open_turn, add_special_tokens=False)
    # SGLang's assistant prefill: the last assistant message is continued without asking
    for extra in ({}, {"continue_final_message": True, "add_generation_prompt": False}):
        r = client.chat.completions.create(model=MODEL, messages=SAYING, max_tokens=2, extra_body={**extra, "return_token_ids": True})
        assert r.prompt_token_ids == prompt
        assert post(stack, "/tokenize", {"messages": SAYING, **extra}).json()["tokens"] == prompt  # the ids it runs
        assert r.choices[0].message.content == tok.decode([prompt[-1] + 1, prompt[-1] + 2], skip_special_tokens=True)
    echoed = client.chat.completions.create(model=MODEL, messages=SAYING, max_tokens=2, extra_body={"echo": True})
    assert echoed.choices[0].message.content.startswith("An apple a day") and echoed.choices[0].message.content != "An apple a day"
    streamed = list(client.chat.completions.create(model=MODEL, messages=SAYING, max_tokens=2, stream=True, extra_body={"echo": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == echoed.choices[0].message.content
    # asking for a new turn closes the assistant's message; asking for both is refused, as vLLM
    new_turn = client.chat.completions.create(model=MODEL, messages=SAYING, max_tokens=1,
                                              extra_body={"add_generation_prompt": True, "return_token_ids": True})
    assert tok.decode(new_turn.prompt_token_ids).endswith("An apple a day<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(openai.BadRequestError, match="Cannot set both"):
        client.chat.completions.create(model=MODEL, messages=SAYING, max_tokens=1,
                                       extra_body={"add_generation_prompt": True, "continue_final_message": True})


@pytest.mark.parametrize(("field", "value"), [
    ("bad_words", ["x"]), ("cache_salt", "s"), ("priority", 3), ("chat_template", "{{ x }}"),
    ("custom_logit_processor", "p"), ("reasoning_effort", "high"), ("token_ids_logprob", [5]),
    ("logprob_token_ids", [5]),
])
def test_a_known_peer_field_we_do_not_implement_is_refused_by_name(stack, field, value):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}), ("/v1/completions", {"prompt": "hi"})):
        r = post(stack, path, {**body, "max_tokens": 1, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "priority": 0,
                                           "an_unknown_field": 1}).status_code == 200  # defaults and unknowns pass


def test_whole_vocabulary_logprobs_past_the_cap_are_refused_in_vllms_words(stack):
    # vllm/sampling_params.py, SamplingParams._validate_logprobs: -1 is the vocabulary (the live
    # tokenizer's 49152), refused past server.max_logprobs (20 by default); completions' logprobs takes no -1
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for path, body, param, says in (
            ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": -1}, "top_logprobs",
             "Requested sample logprobs of 49152, which is greater than max allowed: 20"),
            ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
             "Requested sample logprobs of 21, which is greater than max allowed: 20"),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "prompt_logprobs": -1}, "prompt_logprobs",
             "Requested prompt logprobs of 49152, which is greater than max allowed: 20"),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": -1}, "logprobs", "'logprobs' must be >= 0, got -1")):
        r = post(stack, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param and r.json()["error"]["message"] == says, r.text
