"""Forced tool calls on the JAX worker with SmolLM2's real weights, through the official client:
a named tool_choice and "required" constrain the output (gateway/tools.py), so the calls' arguments
parse and are valid under the function's schema, whole and streamed, and the client's typed
objects (`parsed_arguments` of `chat.completions.parse` with a pydantic tool) read them.

These need the worker's constrained decoding (worker_svc/constrained.py): without it the model
writes free text and no call comes out whole."""

import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
MODEL = "SmolLM2-135M-Instruct"
# Bounded strings: a small model may go on writing one until max_tokens
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time in a time zone", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 32}}, "required": ["timezone"],
    "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SETTINGS = {"model": MODEL, "messages": ASK, "max_tokens": 100, "temperature": 0}


@pytest.fixture(scope="module")
def stack(jax_stack):
    return jax_stack


def valid(call) -> dict:
    """The call's arguments, checked against its function's schema."""
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def test_named_call_arguments_follow_the_schema(client):
    r = client.chat.completions.create(**SETTINGS, tools=[WEATHER, TIME], tool_choice=NAMED)
    choice = r.choices[0]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert valid(call)["unit"] in ("celsius", "fahrenheit")
    assert choice.finish_reason == "stop" and choice.message.content is None  # a named call: the engine's reason, as vLLM and OpenAI


def test_named_call_streamed(client):
    with client.chat.completions.stream(**SETTINGS, tools=[WEATHER, TIME], tool_choice=NAMED) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and valid(call)
    assert "tool_calls.function.arguments.delta" in events and "tool_calls.function.arguments.done" in events
    assert final.choices[0].finish_reason == "stop"


def test_required_calls_follow_their_schemas(client):
    r = client.chat.completions.create(**SETTINGS, tools=[WEATHER, TIME], tool_choice="required")
    choice = r.choices[0]
    assert choice.message.tool_calls and choice.finish_reason == "tool_calls"
    for call in choice.message.tool_calls:
        valid(call)
    one = client.chat.completions.create(**SETTINGS, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1 and valid(one.choices[0].message.tool_calls[0])


def test_required_calls_streamed(client):
    with client.chat.completions.stream(**SETTINGS, tools=[WEATHER, TIME], tool_choice="required") as stream:
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert calls and final.choices[0].finish_reason == "tool_calls" and len({c.id for c in calls}) == len(calls)
    for call in calls:
        valid(call)


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


def test_parse_gives_a_pydantic_tools_parsed_arguments(client):
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    named = client.chat.completions.parse(**SETTINGS, tools=[tool], tool_choice=NAMED)
    (call,) = named.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Weather) and call.function.parsed_arguments.city
    required = client.chat.completions.parse(**SETTINGS, tools=[tool], tool_choice="required")
    assert all(isinstance(c.function.parsed_arguments, Weather) for c in required.choices[0].message.tool_calls)


# SmolLM2 never writes a <tool_call> of its own; a grammar beside tool_choice "auto" makes it write
# one, so the "auto" reader's path (tags in the model's text) runs end to end, whole and streamed.
HERMES_CALL = '''start: "<tool_call>" call "</tool_call>"
call: %json {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": ARGUMENTS},
             "required": ["name", "arguments"], "additionalProperties": false}
'''.replace("ARGUMENTS", json.dumps(WEATHER["function"]["parameters"]))


def test_auto_reads_the_calls_in_the_models_text_whole_and_streamed(client):
    settings = {**SETTINGS, "tools": [WEATHER, TIME], "tool_choice": "auto", "extra_body": {"guided_grammar": HERMES_CALL}}
    r = client.chat.completions.create(**settings)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and valid(call)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    with client.chat.completions.stream(**settings) as stream:
        content = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert not "".join(content).strip()  # nothing of the tags leaked as content
    assert final.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    assert final.choices[0].finish_reason == "tool_calls"
