"""tokenizer_svc/tool_prompt.py through the Preprocessor: tools and the history of calls in the chat
prompt, rendered by a template that knows them, or described in text for one that does not (the
bundled SmolLM2's ChatML)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from jaxstream.protocol import ChatMessage, GenerateRequest, RequestRejected, SamplingParams, TokenizeRequest, ToolCall
from tokenizer_svc.preprocess import Preprocessor

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOLS = json.dumps([WEATHER])
ASK = ChatMessage("user", "Weather in Paris and Rome?")
CALLED = ChatMessage("assistant", "", tool_calls=(ToolCall("call_1", "get_weather", '{"city": "Paris"}'),
                                                  ToolCall("call_2", "get_weather", '{"city": "Rome"}')))
ANSWERED = (ChatMessage("tool", "18C", tool_call_id="call_1", name="get_weather"), ChatMessage("tool", "21C", tool_call_id="call_2"))
HISTORY = (ASK, CALLED, *ANSWERED)

# A template in the manner of Qwen3's (written for this test): tools in the system turn, calls with
# their arguments as a dict through tojson, tool results in a user turn.
NATIVE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}TOOLS:{% for tool in tools %}
{{ tool | tojson }}{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools %}
{%- elif message.role == 'tool' %}<|im_start|>user
[result of {{ message.tool_call_id }}] {{ message.content }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}CALL {{ call.function.name }} {{ call.function.arguments | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


class Templated:
    """The real tokenizer with another chat template."""

    def __init__(self, tokenizer, template: str) -> None:
        self.tokenizer, self.chat_template = tokenizer, template

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def apply_chat_template(self, conversation, **kwargs):
        return self.tokenizer.apply_chat_template(conversation, chat_template=self.chat_template, **kwargs)


@pytest.fixture(scope="module")
def smol(tokenizer_info):
    return Preprocessor(tokenizer_info, None)


@pytest.fixture(scope="module")
def native(tokenizer_info):
    return Preprocessor(dataclasses.replace(tokenizer_info, tokenizer=Templated(tokenizer_info.tokenizer, NATIVE)), None)


def test_a_template_that_ignores_tools_gets_them_in_a_system_message(smol):
    text = smol.render((ASK,), True, tools=TOOLS)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\n") and "You are a helpful AI assistant" not in text  # ours replaces the default
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in system and "<tool_call>" in system
    assert rest == "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n<|im_start|>assistant\n"
    with_system = smol.render((ChatMessage("system", "Be brief."), ASK), True, tools=TOOLS)
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and with_system.count("<|im_start|>system") == 1


def test_a_template_that_ignores_tools_gets_the_history_of_calls_as_text(smol):
    text = smol.render(HISTORY, True, tools=TOOLS)
    calls = ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n')
    results = "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n21C\n</tool_response><|im_end|>\n"
    assert text.endswith(calls + results + "<|im_start|>assistant\n")
    # without tools offered (tool_choice "none"), the history still reads as text, under the template's own system prompt
    plain = smol.render(HISTORY, True)
    assert plain.endswith(calls + results + "<|im_start|>assistant\n") and "<tools>" not in plain
    assert "You are a helpful AI assistant" in plain


def test_a_template_that_knows_tools_renders_them_and_the_calls_itself(native):
    text = native.render(HISTORY, True, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nTOOLS:") and json.dumps(WEATHER) in text.split("<|im_end|>")[0]
    # the arguments reach the template as a dict (its tojson writes an object, not a quoted string)
    assert 'CALL get_weather {"city": "Paris"}\nCALL get_weather {"city": "Rome"}\n' in text
    assert "[result of call_1] 18C" in text and "[result of call_2] 21C" in text and "<tool_response>" not in text
    assert "<tools>" not in native.render(HISTORY, True)  # no tools: the template's own rendering of the history
    assert "[result of call_1] 18C" in native.render(HISTORY, True)


def test_arguments_that_are_not_an_object_reach_the_template_as_written(native):
    odd = ChatMessage("assistant", "", tool_calls=(ToolCall("c", "get_weather", "not json"),))
    assert 'CALL get_weather "not json"' in native.render((ASK, odd), False, tools=TOOLS)


def test_a_template_that_refuses_the_tool_role_gets_the_described_history(tokenizer_info):
    strict = ("{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
              "{{ raise_exception('unknown role') }}{% endif %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    pre = Preprocessor(dataclasses.replace(tokenizer_info, tokenizer=Templated(tokenizer_info.tokenizer, strict)), None)
    text = pre.render(HISTORY, False, tools=TOOLS)
    assert text.startswith("[system] # Tools") and "[user] <tool_response>\n18C" in text


def test_generate_and_tokenize_take_the_tools(smol, tokenizer_info):
    tokenize = smol(TokenizeRequest("t", "g", messages=(ASK,), tools=TOOLS))
    generate = smol(GenerateRequest("r", "g", SamplingParams(), messages=(ASK,), tools=TOOLS))
    assert generate.input_ids == tokenize.token_ids
    assert "<tools>" in tokenizer_info.tokenizer.decode(tokenize.token_ids)
    assert tokenize.token_ids != smol(TokenizeRequest("t", "g", messages=(ASK,))).token_ids


def test_tools_that_are_not_json_are_a_400(smol):
    reply = smol(GenerateRequest("r", "g", SamplingParams(), messages=(ASK,), tools="[{"))
    assert isinstance(reply, RequestRejected) and reply.param == "tools"
