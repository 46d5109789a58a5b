"""gateway/tools.py: reading tools, tool_choice and parallel_tool_calls (every refusal names its
field), the constraint a forced call gets, and chat's response shape with calls, whole and streamed."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gateway.errors import ApiError
from gateway.generation import Result
from gateway.openai_routes import ChatShape
from gateway.messages import chat_messages
from gateway.tool_parser import Piece, joined
from gateway.tools import ToolUse, calls_schema, tool_use
from jaxstream.protocol import ChatMessage, Constraint, FinishReason, RequestOutput, SamplingParams, ToolCall

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "strict": True,
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]


def refusal(body: dict) -> ApiError:
    with pytest.raises(ApiError) as caught:
        tool_use(body)
    assert caught.value.status == 400
    return caught.value


def test_no_tools_is_no_tool_use():
    for body in ({}, {"tools": []}, {"tools": None, "tool_choice": "none"}, {"tool_choice": "auto"}):
        use = tool_use(body)
        assert use.choice == "none" and use.rendered() is None and use.constraint is None and use.reader() is None


def test_tools_default_to_auto_and_reach_the_template_with_only_the_fields_it_uses():
    use = tool_use({"tools": TOOLS})
    assert use.choice == "auto" and use.constraint is None and use.parallel
    rendered = json.loads(use.rendered())
    assert rendered[0] == {"type": "function", "function": {k: v for k, v in WEATHER["function"].items() if k != "strict"}}
    assert rendered[1] == {"type": "function", "function": {"name": "get_time"}}
    assert tool_use({"tools": TOOLS, "tool_choice": "none"}).rendered() is None  # "none": the model is not shown them


def test_named_choice_constrains_the_output_to_the_functions_parameters():
    use = tool_use({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert (use.choice, use.name) == ("named", "get_weather")
    assert use.constraint == Constraint("json_schema", json.dumps(WEATHER["function"]["parameters"]))
    use = tool_use({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert json.loads(use.constraint.spec) == {"type": "object", "properties": {}}  # no parameters: an empty object


def test_required_choice_constrains_the_output_to_an_array_of_calls():
    use = tool_use({"tools": TOOLS, "tool_choice": "required"})
    schema = json.loads(use.constraint.spec)
    assert schema == calls_schema(use.tools, parallel=True)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}],
                [{"name": "get_time", "parameters": {}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(tool_use({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}).constraint.spec)
    assert single["maxItems"] == 1


def test_required_schema_gathers_the_tools_definitions_at_its_root():
    city = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"], "$defs": {"City": city}}}}
    schema = json.loads(tool_use({"tools": [tool], "tool_choice": "required"}).constraint.spec)
    assert schema["$defs"] == {"City": city} and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    jsonschema.validate([{"name": "f", "parameters": {"city": {"name": "Paris"}}}], schema)
    other = json.loads(json.dumps(tool).replace('"f"', '"g"').replace('"name": {"type": "string"}', '"zip": {"type": "string"}'))
    assert refusal({"tools": [tool, other], "tool_choice": "required"}).param == "tools[1].function.parameters"


@pytest.mark.parametrize("body,param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [TIME] * 129}, "tools"),
    ({"tools": ["get_time"]}, "tools[0]"),
    ({"tools": [TIME, {"type": "retrieval", "function": {"name": "r"}}]}, "tools[1].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": 7}}]}, "tools[0].function.name"),
    ({"tools": [TIME, TIME]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}, "tools[0].function.description"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": 1}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice.type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    # a schema the grammar library cannot use: named by the tool it belongs to
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[0].function.parameters"),
    ({"tools": [TIME, {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"$ref": "#/$defs/X"}}}}}],
      "tool_choice": "required"}, "tools[1].function.parameters"),
])
def test_every_bad_field_is_a_400_naming_it(body, param):
    error = refusal(body)
    assert error.param == param and error.message, error.message


def test_a_forced_call_with_another_constraint_names_both():
    use = tool_use({"tools": TOOLS, "tool_choice": "required"})
    already = SamplingParams(constraint=Constraint("json_schema", '{"type": "object"}'))
    with pytest.raises(ApiError) as caught:
        use.constrained(already, {"response_format": {"type": "json_object"}})
    assert caught.value.param == "tool_choice" and "'response_format'" in caught.value.message
    assert use.constrained(SamplingParams(), {}).constraint == use.constraint
    auto = tool_use({"tools": TOOLS})
    assert auto.constrained(already, {}) is already  # "auto" constrains nothing: any other constraint stands


STOP, LENGTH = FinishReason("stop"), FinishReason("length", length=5)
HERMES = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("choice,text,finish,content,names,reason", [
    ("auto", HERMES, STOP, "Checking.", ["get_weather"], "tool_calls"),
    ("auto", "<tool_call>{bad}</tool_call>", STOP, "<tool_call>{bad}</tool_call>", [], "stop"),
    ("auto", HERMES, LENGTH, "Checking.", ["get_weather"], "length"),  # cut short: the engine's reason stands
    ("none", HERMES, STOP, HERMES, [], "stop"),
    ("required", '[{"name": "get_time", "parameters": {}}]', STOP, None, ["get_time"], "tool_calls"),
    ("required", '[{"name": "get_time", "para', LENGTH, '[{"name": "get_time", "para', [], "length"),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Paris"}', STOP, None, ["get_weather"], "stop"),
])
def test_chat_message_and_finish_reason_whole_and_streamed(choice, text, finish, content, names, reason):
    shape = ChatShape("r", "m", None, tool_use({"tools": TOOLS, "tool_choice": choice}))
    result = Result(text=text, finish=finish)
    whole = shape.choice(0, result)
    message = whole["message"]
    assert message["content"] == content and [c["function"]["name"] for c in message.get("tool_calls", [])] == names
    assert whole["finish_reason"] == reason
    if names and choice != "required":
        assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    # streamed in 3-character outputs: the chunks add up to the same message and end with the same reason
    chunks = [{"delta": c["delta"], "finish_reason": c["finish_reason"]} for c in shape.opening(0)]  # the role, first
    for at in range(0, len(text), 3):
        last = at + 3 >= len(text)
        chunks += shape.delta(0, RequestOutput("r", text=text[at:at + 3], token_ids=(1,), finish=finish if last else None))
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
    streamed_content = "".join(c["delta"].get("content") or "" for c in chunks)
    calls = [c["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["delta"]]
    assert [c["function"].get("name") for c in calls if "id" in c] == names
    _, joined_calls = joined([Piece(call=c) for c in calls])
    assert [c["function"] for c in joined_calls] == [c["function"] for c in message.get("tool_calls", [])]
    assert streamed_content == (content or "")
    assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == [reason]


def test_streamed_outputs_held_back_still_carry_their_token_ids():
    shape = ChatShape("r", "m", None, ToolUse(tools=(WEATHER,), choice="auto"))
    shape.extras = type(shape.extras)(token_ids=True)
    chunks = shape.opening(0) + shape.delta(0, RequestOutput("r", text="<tool_call>{", token_ids=(5, 6)))
    assert [c["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {}] and chunks[1]["token_ids"] == [5, 6]


def test_chat_messages_carry_the_history_of_calls():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = chat_messages({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": [{"type": "text", "text": "18C"}], "tool_call_id": "call_1", "name": "get_weather"},
    ]})
    assert messages[1] == ChatMessage("assistant", "", tool_calls=(ToolCall("call_1", "get_weather", '{"city": "Paris"}'),))
    assert messages[2] == ChatMessage("tool", "18C", tool_call_id="call_1", name="get_weather")


@pytest.mark.parametrize("message,param", [
    ({"role": "tool", "content": "18C"}, "messages[0].tool_call_id"),
    ({"role": "tool", "content": None, "tool_call_id": "c"}, "messages[0].content"),
    ({"role": "assistant", "content": None}, "messages[0].content"),
    ({"role": "assistant", "tool_calls": {"id": "c"}}, "messages[0].tool_calls"),
    ({"role": "assistant", "tool_calls": ["c"]}, "messages[0].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}, "messages[0].tool_calls[0].id"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "function": {"name": "f"}}]}, "messages[0].tool_calls[0].type"),
    ({"role": "assistant", "tool_calls": [{"id": "c"}]}, "messages[0].tool_calls[0].function"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}, "messages[0].tool_calls[0].function.name"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": 1}}}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_history_of_calls_is_a_400_naming_the_field(message, param):
    with pytest.raises(ApiError) as caught:
        chat_messages({"messages": [message]})
    assert caught.value.param == param
