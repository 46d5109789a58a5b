"""GPT-OSS's Harmony format with openai-harmony, on recorded token sequences: its vocabulary made
offline (jaxstream/harmony.py), a chat rendered to prompt ids (tokenizer_svc/harmony_prompt.py, and
the tokenizer's stop ids for it), an output read by channel by the detokenizer
(detokenizer_svc/channels.py) and into reasoning, content and tool calls by the gateway
(gateway/harmony.py), whole and streamed token by token alike.

The outputs are written as gpt-oss writes them (its header: `<|channel|>commentary
to=functions.NAME <|constrain|>json<|message|>`) and encoded by openai-harmony, special tokens
included. The vocabulary comes from quicktok-v1 (the test extra) or TIKTOKEN_ENCODINGS_BASE;
without either the tests that need it skip, saying so."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from types import SimpleNamespace

import pytest

from detokenizer_svc.channels import Channels
from detokenizer_svc.request import DetokRequest
from gateway.errors import ApiError
from gateway.harmony import HarmonyReading, harmony_turn
from gateway.messages import chat_messages
from gateway.reasoning import Reading
from jaxstream import harmony
from jaxstream.config import ConfigError
from jaxstream.config.model import ModelConfig
from jaxstream.model_files import TokenizerInfo
from jaxstream.protocol import ChannelText, ChatMessage, FinishRule, GenerateRequest, RequestStart, SamplingParams, ToolCall
from tokenizer_svc.harmony_prompt import HarmonyPrompt
from tokenizer_svc.preprocess import Preprocessor

WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# Recorded outputs (after the prompt's `<|start|>assistant`), as gpt-oss writes them
THINK_ANSWER = "<|channel|>analysis<|message|>The user asks about Paris.<|end|><|start|>assistant<|channel|>final<|message|>Paris is sunny.<|return|>"
CALL = ('<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant<|channel|>commentary '
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
PREAMBLE_TWO_CALLS = ('<|channel|>commentary<|message|>Checking both.<|end|>'
                      '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|end|>'
                      '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}<|call|>')


@pytest.fixture(scope="module")
def encoding():
    if not os.environ.get(harmony.BASE_VAR) and harmony.quicktok_table() is None \
            and not (harmony.cache_dir() / harmony.VOCAB_FILE).is_file():
        pytest.skip("openai-harmony's o200k vocabulary is not here: pip install quicktok-v1==0.4.0 (the test extra), "
                    "or set TIKTOKEN_ENCODINGS_BASE")
    return harmony.encoding()


def tokens(encoding, text: str) -> list[int]:
    return encoding.encode(text, allowed_special="all")


def test_the_vocabulary_made_from_quicktok_is_the_published_file(tmp_path):
    if harmony.quicktok_table() is None:
        pytest.skip("quicktok-v1 is not installed (the test extra)")
    written = harmony.write_vocabulary(tmp_path)
    assert hashlib.sha256(written.read_bytes()).hexdigest() == harmony.VOCAB_SHA256
    assert not list(tmp_path.glob("*.tiktoken.*"))  # no partial file left


def test_the_binary_table_becomes_tiktoken_lines_by_rank():
    table = struct.pack("<I", 2) + struct.pack("<H", 2) + b"ab" + struct.pack("<I", 1) + struct.pack("<H", 1) + b"!" + struct.pack("<I", 0)
    assert harmony.tiktoken_text(table) == b"IQ== 0\nYWI= 1\n"


def test_a_harmony_model_has_both_parsers_or_neither():
    assert ModelConfig(tool_parser="openai", reasoning_parser="openai_gptoss").harmony
    assert not ModelConfig(tool_parser="hermes", reasoning_parser="qwen3").harmony
    with pytest.raises(ConfigError, match="model.reasoning_parser"):
        ModelConfig(tool_parser="openai", reasoning_parser=None)
    with pytest.raises(ConfigError, match="model.tool_parser"):
        ModelConfig(tool_parser="hermes", reasoning_parser="openai_gptoss")


def test_a_chat_renders_as_harmony_with_its_tools_effort_calls_and_results(encoding):
    prompt = HarmonyPrompt(encoding)
    messages = (ChatMessage("system", "Answer briefly."), ChatMessage("user", "Weather in Paris?"),
                ChatMessage("assistant", "Let me look.", tool_calls=(ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
                ChatMessage("tool", '{"celsius": 20}', tool_call_id="call_1"))
    ids = prompt.render(messages, True, False, json.dumps(WEATHER), json.dumps({"reasoning_effort": "high"}))
    text = encoding.decode(ids)
    assert text.startswith("<|start|>system<|message|>") and "Reasoning: high" in text
    assert "<|start|>developer<|message|># Instructions\n\nAnswer briefly.\n\n# Tools" in text
    assert "// The weather in a city\ntype get_weather = (_: {\ncity?: string,\n}) => any;" in text
    assert ("<|start|>user<|message|>Weather in Paris?<|end|>"
            "<|start|>assistant<|channel|>commentary<|message|>Let me look.<|end|>"
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"celsius": 20}<|end|>'
            "<|start|>assistant") in text
    assert text.endswith("<|start|>assistant")
    # an earlier answer is on the final channel; without a generation prompt the conversation ends with it
    answered = prompt.render((ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello.")), False, False, None, None)
    assert encoding.decode(answered).endswith("<|start|>assistant<|channel|>final<|message|>Hello.<|end|>")
    # a named tool_choice: the call's header ends the prompt, so the output is its arguments
    forced = prompt.render(messages[:2], True, False, json.dumps(WEATHER), None, forced_call="get_weather")
    assert encoding.decode(forced).endswith(
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>")


def test_the_thinking_sent_back_is_analysis_kept_for_calls_and_dropped_once_answered(encoding):
    messages = chat_messages({"messages": [
        {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "reasoning": "think1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": None, "reasoning_content": "think2",
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "r"}]})
    text = encoding.decode(HarmonyPrompt(encoding).render(messages, True, False, None, None))
    assert "think1" not in text and "<|start|>assistant<|channel|>final<|message|>A1<|end|>" in text
    assert ("<|start|>assistant<|channel|>analysis<|message|>think2<|end|>"
            "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>") in text
    assert harmony_turn({}, messages[:2]) == {"continue_final_message": False}  # ends with the assistant's: a new turn
    assert harmony_turn({"continue_final_message": True}, messages[:2]) == {"continue_final_message": True}
    with pytest.raises(ApiError) as bad:
        chat_messages({"messages": [{"role": "assistant", "content": "A", "reasoning": 3}]})
    assert bad.value.param == "messages[0].reasoning"


@pytest.mark.parametrize("messages, options, param", [
    ((ChatMessage("narrator", "x"),), {}, "messages[0].role"),
    ((ChatMessage("user", "x"), ChatMessage("tool", "20", tool_call_id="nope")), {}, "messages[1].tool_call_id"),
    ((ChatMessage("user", "x"), ChatMessage("assistant", "Par")), {"continue_final_message": True}, "continue_final_message"),
    ((ChatMessage("user", "x"),), {"kwargs": {"reasoning_effort": "extreme"}}, "reasoning_effort"),
    ((ChatMessage("user", "x"),), {"kwargs": {"model_identity": 3}}, "chat_template_kwargs.model_identity"),
])
def test_what_harmony_cannot_render_is_a_400_naming_the_field(encoding, messages, options, param):
    preprocess = Preprocessor(TokenizerInfo(SimpleNamespace(), (199999,), 131072, 201088), None, harmony=HarmonyPrompt(encoding))
    kwargs = options.get("kwargs")
    request = GenerateRequest("r", "g", SamplingParams(), messages=messages, continue_final_message=options.get("continue_final_message", False),
                              chat_template_kwargs=json.dumps(kwargs) if kwargs else None)
    rejected = preprocess(request)
    assert (rejected.status, rejected.param) == (400, param), rejected


def test_a_harmony_chat_stops_at_return_and_call_even_with_ignore_eos(encoding):
    preprocess = Preprocessor(TokenizerInfo(SimpleNamespace(), (199999,), 131072, 201088), None, harmony=HarmonyPrompt(encoding))
    chat = GenerateRequest("r", "g", SamplingParams(max_new_tokens=8), messages=(ChatMessage("user", "Hi"),))
    assert preprocess(chat).finish.stop_token_ids == (200002, 200012, 199999)
    ignoring = GenerateRequest("r", "g", SamplingParams(max_new_tokens=8, ignore_eos=True), messages=(ChatMessage("user", "Hi"),))
    assert preprocess(ignoring).finish.stop_token_ids == (200002, 200012)
    text = GenerateRequest("r", "g", SamplingParams(max_new_tokens=8), input_ids=(1, 2))  # not a chat: the EOS alone
    assert preprocess(text).finish.stop_token_ids == (199999,)


def read(encoding, recorded: str, by_token: bool, calls: bool = True, single: bool = False) -> tuple[dict, list[ChannelText]]:
    """The message a recorded output makes: the detokenizer's channels (token by token, or in one
    output), read whole by the gateway; with by_token, the stream's deltas added up instead."""
    ids, channels = tokens(encoding, recorded), Channels(encoding)
    outputs = [channels.feed([t], last=i == len(ids) - 1) for i, t in enumerate(ids)] if by_token else [channels.feed(ids, last=True)]
    pieces = [p for out in outputs for p in out]
    if not by_token:
        return HarmonyReading(calls, single).whole(pieces)[0], pieces
    reader, message = HarmonyReading(calls, single), {"content": "", "reasoning_content": "", "tool_calls": []}
    for out in outputs:
        for delta in reader.deltas(out, False):
            if "tool_calls" in delta:
                call = delta["tool_calls"][0]
                if "id" in call:
                    message["tool_calls"].append({"id": call["id"], "type": "function", "function": dict(call["function"])})
                else:
                    message["tool_calls"][call["index"]]["function"]["arguments"] += call["function"]["arguments"]
            else:
                for key in ("content", "reasoning_content"):
                    message[key] += delta.get(key) or ""
    return {k: v or None for k, v in message.items()}, pieces


@pytest.mark.parametrize("by_token", [False, True], ids=["whole", "streamed"])
def test_the_analysis_channel_is_reasoning_and_the_final_one_content(encoding, by_token):
    message, pieces = read(encoding, THINK_ANSWER, by_token)
    assert (message["reasoning_content"], message["content"], message.get("tool_calls") or None) == (
        "The user asks about Paris.", "Paris is sunny.", None)
    assert {(p.message, p.channel, p.recipient) for p in pieces} == {(0, "analysis", ""), (1, "final", "")}


@pytest.mark.parametrize("by_token", [False, True], ids=["whole", "streamed"])
def test_a_commentary_message_to_a_function_is_a_tool_call(encoding, by_token):
    message, _ = read(encoding, CALL, by_token)
    assert (message["reasoning_content"], message["content"]) == ("Need the weather tool.", None)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [("get_weather", '{"city": "Paris"}')]
    assert message["tool_calls"][0]["id"].startswith("call_")


@pytest.mark.parametrize("by_token", [False, True], ids=["whole", "streamed"])
def test_two_calls_of_one_function_are_two_calls_after_a_preamble_shown_as_content(encoding, by_token):
    message, _ = read(encoding, PREAMBLE_TWO_CALLS, by_token)
    assert message["content"] == "Checking both." and message["reasoning_content"] is None
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"city": "Paris"}', '{"city": "Rome"}']
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    single, _ = read(encoding, PREAMBLE_TWO_CALLS, by_token, single=True)  # parallel_tool_calls false: the first
    assert [c["function"]["arguments"] for c in single["tool_calls"]] == ['{"city": "Paris"}']


def test_with_tool_choice_none_a_call_is_not_read():
    reader = HarmonyReading(calls=False)
    message, called = reader.whole([ChannelText(0, "commentary", "functions.f", '{"a": 1}')])
    assert (message["content"], called, "tool_calls" in message) == ('{"a": 1}', False, False)


def test_an_output_that_leaves_the_format_goes_on_as_plain_text(encoding):
    channels = Channels(encoding)
    ids = tokens(encoding, "<|channel|>final<|message|>Hi<|end|>") + tokens(encoding, "<|message|>café")
    pieces = [p for i in range(len(ids)) for p in channels.feed([ids[i]], last=i == len(ids) - 1)]
    assert (pieces[0].channel, pieces[0].text) == ("final", "Hi")
    assert {p.channel for p in pieces[1:]} == {""} and "".join(p.text for p in pieces[1:]) == "<|message|>café"
    message, _ = HarmonyReading(calls=True).whole(pieces)
    assert message["content"] == "Hi<|message|>café"


def test_the_detokenizer_sends_each_outputs_channels_beside_its_plain_text(encoding):
    ids = tokens(encoding, CALL)
    start = RequestStart("r", "g", 3, (), FinishRule((200002, 200012), 64), channels=True)
    request = DetokRequest(start, SimpleNamespace(decode=lambda ids, **_: encoding.decode(ids)))
    first, rest = request.on_tokens(ids[:4], [0.0] * 4), request.on_tokens(ids[4:], [0.0] * (len(ids) - 4))
    assert first.channels == (ChannelText(0, "analysis", "", "Need"),)
    assert rest.finish.matched == 200012 and [(p.channel, p.recipient) for p in rest.channels] == [
        ("analysis", ""), ("commentary", "functions.get_weather")]
    plain = DetokRequest(RequestStart("q", "g", 3, (), FinishRule((200002,), 64)), SimpleNamespace(decode=lambda ids, **_: encoding.decode(ids)))
    assert plain.on_tokens(ids[:4], [0.0] * 4).channels == ()  # a request that did not ask


def test_a_thinking_reader_and_the_harmony_reader_say_whether_they_read():
    assert Reading(None, None).plain and not HarmonyReading(calls=True).plain
