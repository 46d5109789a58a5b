"""Tool calls on chat completions through the whole fake stack with the official client: every
tool_choice is served, refusals name their field, and /tokenize shows the tools in the prompt.
The fake worker ignores constraints (its output is t+1, t+2, ... after the prompt's last token t:
worker_svc/fake.py), so what a forced call's output looks like is tested on the JAX worker
(test_tool_calls_jax.py) and the reading of calls in tests/unit/test_tool_parser.py."""

import httpx
import openai
import pytest

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def stack(fake_stack):
    return fake_stack


@pytest.mark.parametrize("tool_choice", ["auto", "none", "required"])
def test_every_tool_choice_is_served(client, tool_choice):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=tool_choice, max_tokens=4)
    # the fake's text is no call: it is the content, and the engine's finish reason stands
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "length"


def test_a_named_tool_choice_makes_the_output_that_functions_arguments(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=4)
    (call,) = r.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert r.choices[0].message.content is None and r.usage.completion_tokens == 4
    text = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4).choices[0].message.content
    assert call.function.arguments == text  # the output as written (the fake's follows the prompt's last token, the same)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=4,
                                                 stream=True))
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def test_a_conversation_with_calls_and_their_results_is_served(client):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=2)
    assert r.usage.completion_tokens == 2


@pytest.mark.parametrize("body,param", [
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"messages": ASK + [{"role": "tool", "content": "18C"}]}, "messages[1].tool_call_id"),
])
def test_bad_tool_fields_are_400s_naming_them(stack, body, param):
    r = httpx.post(stack + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_client_raises_on_a_bad_tool_choice(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=2,
                                       tool_choice={"type": "function", "function": {"name": "get_news"}})


def test_tokenize_shows_the_tools_in_the_prompt(stack, tokenizer_info):
    body = {"model": MODEL, "messages": ASK}
    plain = httpx.post(stack + "/tokenize", json=body, timeout=10).json()["tokens"]
    tokens = httpx.post(stack + "/tokenize", json={**body, "tools": [WEATHER]}, timeout=10).json()["tokens"]
    text = tokenizer_info.tokenizer.decode(tokens)
    assert "<tools>" in text and '"name": "get_weather"' in text and len(tokens) > len(plain)
    # what the chat runs: a chat with the tools counts the same prompt tokens
    r = httpx.post(stack + "/v1/chat/completions", json={**body, "tools": [WEATHER], "max_tokens": 1}, timeout=10).json()
    assert r["usage"]["prompt_tokens"] == len(tokens)
    none = httpx.post(stack + "/tokenize", json={**body, "tools": [WEATHER], "tool_choice": "none"}, timeout=10).json()["tokens"]
    assert none == plain
