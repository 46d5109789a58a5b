"""gateway/tool_syntaxes.py: tool_choice "auto" read in each family's syntax (model.tool_parser), on
recorded outputs: Mistral's `[TOOL_CALLS]` array, Llama 3's JSON, DeepSeek-V3's marked section and
Qwen3-Coder's (Qwen3.5's) XML, whole and in every chunking."""

from __future__ import annotations

import pytest

from gateway.tool_parser import Piece, joined
from gateway.tool_syntaxes import DeepSeekV3Calls, Llama3JsonCalls, MistralCalls, Qwen3CoderCalls, mistral_call_id
from gateway.tools import tool_use
from jaxstream.config import TOOL_PARSERS
from jaxstream.protocol import SamplingParams
from tests.unit.test_tool_parser import CITY, call, counter, every_chunking

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}

MISTRAL_CASES = [
    # text, content, calls (Mistral-7B-Instruct-v0.3 writes the token, a space, then the array)
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', "",
     [call(0, "get_weather", CITY)]),
    ('Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
     '{"name": "get_time", "arguments": {}}]', "Checking.", [call(0, "get_weather", CITY), call(1, "get_time", {})]),
    ("The weather is sunny.", "The weather is sunny.", []),
    # a start of the token that never completes is text
    ("a [TOOL_CAL", "a [TOOL_CAL", []),
    # an array with no call in it: the whole output is the answer, as written
    ("[TOOL_CALLS] [1, 2]", "[TOOL_CALLS] [1, 2]", []),
    ("Hm [TOOL_CALLS] not json", "Hm [TOOL_CALLS] not json", []),
    # cut short: the calls whose objects closed
    ('[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g", "argu', "", [call(0, "f", {})]),
]


@pytest.mark.parametrize("text,content,calls", MISTRAL_CASES)
def test_mistral_whole_and_every_chunking_agree(text, content, calls):
    for got in every_chunking(lambda: MistralCalls(new_id=counter()), text):
        assert got == (content, calls)


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "", [call(0, "get_weather", CITY)]),
    # <|python_tag|> (when special tokens are kept), "arguments" for "parameters", two calls with `;`
    ('<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}; {"name": "get_time", '
     '"parameters": {}}', "", [call(0, "get_weather", CITY), call(1, "get_time", {})]),
    ('\n\n{"name": "f", "parameters": {"s": "};{"}}', "", [call(0, "f", {"s": "};{"})]),
    # an answer in words is the content, whatever it holds later
    ('It is sunny. {"name": "f", "parameters": {}}', 'It is sunny. {"name": "f", "parameters": {}}', []),
    ("<b>bold</b>", "<b>bold</b>", []),
    # JSON that is no call: the whole output is the answer
    ('{"answer": 42}', '{"answer": 42}', []),
    (' {"name": "f", "param', ' {"name": "f", "param', []),
    ("", "", []),
    ("  ", "  ", []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES)
def test_llama3_json_whole_and_every_chunking_agree(text, content, calls):
    for got in every_chunking(lambda: Llama3JsonCalls(new_id=counter()), text):
        assert got == (content, calls)


def deepseek(name: str, arguments: str) -> str:
    """One call as DeepSeek-V3 (and R1) write it: its type, name, and arguments in a ```json fence."""
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```<｜tool▁call▁end｜>"


WEATHER_CALL = deepseek("get_weather", '{"city": "Paris", "unit": "celsius"}')
DEEPSEEK_CASES = [
    # the shape of DeepSeek-V3-0324's and R1's outputs (their chat templates' and vLLM's and SGLang's
    # parsers' examples): the section, calls a newline apart, the section's end, then the end of sentence
    (f"<｜tool▁calls▁begin｜>{WEATHER_CALL}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>", "", [call(0, "get_weather", CITY)]),
    (f"Let me check both.\n\n<｜tool▁calls▁begin｜>{WEATHER_CALL}\n{deepseek('get_time', '{}')}<｜tool▁calls▁end｜>",
     "Let me check both.\n\n", [call(0, "get_weather", CITY), call(1, "get_time", {})]),
    ("The weather is sunny.", "The weather is sunny.", []),
    ("a <｜tool▁calls", "a <｜tool▁calls", []),  # a start of the marker that never completes is text
    # arguments written again compactly, whatever the model's whitespace; a fence left out reads alike
    ("<｜tool▁calls▁begin｜>" + deepseek("f", '{\n  "a": [1,  2]\n}') +
     "<｜tool▁call▁begin｜>function<｜tool▁sep｜>g\n{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "",
     [call(0, "f", {"a": [1, 2]}), call(1, "g", {})]),
    # cut short (max_tokens): the calls whose arguments are whole, the last one's end unwritten too
    (f"<｜tool▁calls▁begin｜>{WEATHER_CALL}\n{deepseek('get_time', '{}')[:-len('<｜tool▁call▁end｜>') - 2]}", "",
     [call(0, "get_weather", CITY), call(1, "get_time", {})]),
    (f"<｜tool▁calls▁begin｜>{WEATHER_CALL}\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_ti", "", [call(0, "get_weather", CITY)]),
    # no call in the section (arguments no JSON object, no name line): the whole output, as written
    ("Hm <｜tool▁calls▁begin｜>" + deepseek("f", "[1, 2]"), "Hm <｜tool▁calls▁begin｜>" + deepseek("f", "[1, 2]"), []),
    ("<｜tool▁calls▁begin｜>not a call", "<｜tool▁calls▁begin｜>not a call", []),
    # text after the section is not read, as vLLM's reader leaves it
    (f"<｜tool▁calls▁begin｜>{WEATHER_CALL}<｜tool▁calls▁end｜> and more", "", [call(0, "get_weather", CITY)]),
]


@pytest.mark.parametrize("text,content,calls", DEEPSEEK_CASES)
def test_deepseek_v3_whole_and_every_chunking_agree(text, content, calls):
    for got in every_chunking(lambda: DeepSeekV3Calls(new_id=counter()), text):
        assert got == (content, calls)


def test_deepseek_v3_streams_words_as_they_come_each_call_as_it_ends_and_keeps_one_when_asked():
    reader = DeepSeekV3Calls(new_id=counter())
    assert reader.feed("Ok <｜tool▁") == [Piece(content="Ok ")]  # the marker's start held
    assert reader.feed("calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\"") == [] and not reader.called
    assert [p.call["function"] for p in reader.feed(': 1}\n```<｜tool▁call▁end｜>')] == [{"name": "f", "arguments": ""},
                                                                                    {"arguments": '{"a": 1}'}]
    assert reader.feed("<｜tool▁calls▁end｜>") == [] and reader.finish() == []
    single = DeepSeekV3Calls(single=True, new_id=counter())  # parallel_tool_calls false
    text = f"<｜tool▁calls▁begin｜>{WEATHER_CALL}\n{deepseek('get_time', '{}')}<｜tool▁calls▁end｜>"
    assert joined(single.feed(text) + single.finish()) == ("", [call(0, "get_weather", CITY)])


def test_streams_give_words_as_they_come_and_each_call_as_its_object_closes():
    llama = Llama3JsonCalls(new_id=counter())
    assert llama.feed("Sun") == [Piece(content="Sun")] and llama.feed("ny.") == [Piece(content="ny.")]
    llama = Llama3JsonCalls(new_id=counter())
    assert llama.feed("<|python") == [] and llama.feed('_tag|>{"name": "f", "parameters": {"a"') == []
    assert [p.call["function"] for p in llama.feed(": 1}}")] == [{"name": "f", "arguments": ""}, {"arguments": '{"a": 1}'}]
    mistral = MistralCalls(new_id=counter())
    assert mistral.feed("Ok [TOOL") == [Piece(content="Ok ")]  # the token's start held
    assert mistral.feed('_CALLS] [{"name": "f", "arguments": {"a"') == [] and not mistral.called
    assert [p.call["function"] for p in mistral.feed(": 1}}")] == [{"name": "f", "arguments": ""}, {"arguments": '{"a": 1}'}]
    assert mistral.called and mistral.feed("]</s>") == [] and mistral.finish() == []  # after the array: nothing more read


def test_the_model_config_chooses_the_auto_reader_and_mistral_keeps_special_tokens():
    # "openai": Harmony's channels, gateway/harmony.py
    assert TOOL_PARSERS == ("hermes", "mistral", "llama3_json", "openai", "deepseek_v3", "qwen3_coder")
    body = {"tools": [WEATHER]}
    assert type(tool_use(body).reader()).__name__ == "HermesCalls"
    assert type(tool_use(body, "llama3_json").reader()).__name__ == "Llama3JsonCalls"
    assert isinstance(tool_use(body, "deepseek_v3").reader(), DeepSeekV3Calls)
    # its markers are no special tokens of DeepSeek's vocabulary: skip_special_tokens left as asked
    assert tool_use(body, "deepseek_v3").constrained(SamplingParams(), body).skip_special_tokens
    mistral = tool_use(body, "mistral")
    assert isinstance(mistral.reader(), MistralCalls)
    # [TOOL_CALLS] is a special token: kept in the text for "auto", as vLLM's adjust_request
    assert mistral.constrained(SamplingParams(), body).skip_special_tokens is False
    assert tool_use({**body, "tool_choice": "none"}, "mistral").constrained(SamplingParams(), body).skip_special_tokens
    assert tool_use(body, "hermes").constrained(SamplingParams(), body).skip_special_tokens
    # Mistral's template takes back only ids of 9 letters and digits: every choice's calls get such ids
    named = tool_use({**body, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "mistral")
    for use, text in ((named, "{}"), (mistral, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {}}]')):
        reader = use.reader()
        ids = [p.call["id"] for p in reader.feed(text) + reader.finish() if "id" in p.call]
        assert len(ids) == 1 and len(ids[0]) == 9 and ids[0].isalnum()
    assert mistral_call_id() != mistral_call_id()


# Qwen3.5's tools, typed by their schemas (its chat template renders them; the calls come back as text)
TYPED_TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string"}}}}},
               {"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
                   "nights": {"type": "integer"}, "price": {"type": "number"}, "late": {"type": "boolean"},
                   "rooms": {"type": "array"}, "code": {"type": "string"}, "note": {"type": ["string", "null"]}}}}})


def qwen3_coder(name: str, **parameters: str) -> str:
    """A call as Qwen3.5's chat template lays one out (vLLM's qwen3_coder reads it)."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


QWEN3_CODER_CASES = [
    (qwen3_coder("get_weather", city="Paris", unit="celsius"), "", [call(0, "get_weather", CITY)]),
    # text, then two calls; the values read by their types; a string of digits stays a string
    ("Let me book.\n" + qwen3_coder("book", nights="3", price="99.5", late="true", rooms='["a", "b"]', code="007", note="null")
     + "\n" + qwen3_coder("get_time"), "Let me book.",
     [call(0, "book", {"nights": 3, "price": 99.5, "late": True, "rooms": ["a", "b"], "code": "007", "note": None}),
      call(1, "get_time", {})]),
    # a value its type does not read, an unknown parameter, a multi-line string: as written
    (qwen3_coder("book", nights="three", extra="x\ny"), "", [call(0, "book", {"nights": "three", "extra": "x\ny"})]),
    # cut short inside the last parameter: the call with what it holds (Hermes's rule for a last open call)
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis", "", [call(0, "get_weather", {"city": "Paris"})]),
    # no function in the tags: the output as written
    ("<tool_call>\nnot xml\n</tool_call>", "<tool_call>\nnot xml\n</tool_call>", []),
    ("No call today.", "No call today.", []),
]


@pytest.mark.parametrize("text,content,calls", QWEN3_CODER_CASES)
def test_qwen3_coder_whole_and_every_chunking_agree(text, content, calls):
    for got in every_chunking(lambda: Qwen3CoderCalls(new_id=counter(), tools=TYPED_TOOLS), text):
        assert got == (content, calls)


def test_qwen3_coder_is_read_with_the_requests_tools():
    """gateway/tools.py hands the request's tools to the reader: an integer parameter reads as one."""
    reader = tool_use({"tools": list(TYPED_TOOLS)}, "qwen3_coder").reader()
    assert isinstance(reader, Qwen3CoderCalls)
    _, calls = joined(reader.feed(qwen3_coder("book", nights="2")) + reader.finish())
    assert [c["function"] for c in calls] == [{"name": "book", "arguments": '{"nights": 2}'}]
