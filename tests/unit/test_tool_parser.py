"""gateway/tool_parser.py: tool calls read out of a model's text, whole and streamed in any chunking
(a stream must add up to the whole response: same content, same calls)."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from gateway.tool_parser import ArrayCalls, HermesCalls, NamedCall, Piece, joined, whole


def counter():
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def call(n: int, name: str, arguments: dict) -> dict:
    return {"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def chunked(make, text: str, sizes) -> tuple[list[Piece], tuple[str, list[dict]]]:
    """The pieces of `text` fed in chunks of `sizes` (cycled), and what they add up to."""
    reader, pieces, at = make(), [], 0
    for size in itertools.cycle(sizes):
        if at >= len(text):
            break
        pieces += reader.feed(text[at:at + size])
        at += size
    pieces += reader.finish()
    return pieces, joined(pieces)


def every_chunking(make, text: str, seed: int = 0):
    """Char by char, whole, and a few random chunkings: each one's joined pieces."""
    rng = random.Random(seed)
    sizings = [[1], [len(text) or 1], [2, 3], *([rng.randint(1, 12) for _ in range(20)] for _ in range(5))]
    return [chunked(make, text, sizes)[1] for sizes in sizings]


CITY = {"city": "Paris", "unit": "celsius"}
TWO_CALLS = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')

HERMES_CASES = [
    # text, content, calls
    ("Just an answer.", "Just an answer.", []),
    ("", "", []),
    ("  \n", "  \n", []),  # whitespace alone is still the answer when nothing was called
    (TWO_CALLS, "Let me check both.", [call(0, "get_weather", CITY), call(1, "get_time", {})]),
    # calls alone: whitespace around them is no content
    ('\n<tool_call>{"name": "f", "arguments": {"a": [1, {"b": "}"}]}}</tool_call>\n\n', "", [call(0, "f", {"a": [1, {"b": "}"}]})]),
    # text between and after calls is content, in order
    ('A <tool_call>{"name": "f", "arguments": {}}</tool_call> B <tool_call>{"name": "g", "arguments": {}}</tool_call> C',
     "A  B  C", [call(0, "f", {}), call(1, "g", {})]),
    # arguments are written again compactly, unicode kept
    ('<tool_call>{"name":"f","arguments":{"x":"é",\n"y":1}}</tool_call>', "", [call(0, "f", {"x": "é", "y": 1}) | {
        "function": {"name": "f", "arguments": '{"x": "é", "y": 1}'}}]),
    # no arguments: an empty object
    ('<tool_call>{"name": "f"}</tool_call>', "", [call(0, "f", {})]),
    # a last call left open (the output ended before </tool_call>)
    ('Sure: <tool_call>{"name": "f", "arguments": {"a": 1}}', "Sure:", [call(0, "f", {"a": 1})]),
    # malformed JSON, or JSON that is no call, stays in the content as written
    ("x <tool_call>{not json}</tool_call> y", "x <tool_call>{not json}</tool_call> y", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": {"a": ', '<tool_call>{"name": "f", "arguments": {"a": ', []),  # cut short
    # a malformed call beside a good one: the good one is a call, the other content
    ('<tool_call>{bad}</tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call>', "<tool_call>{bad}</tool_call>",
     [call(0, "f", {})]),
    # the start of a tag at the end is text after all
    ("a < b and <tool_ca", "a < b and <tool_ca", []),
    ("<tool_call", "<tool_call", []),
    ("not a <tool_cal1> tag", "not a <tool_cal1> tag", []),
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_whole_and_every_chunking_agree(text, content, calls):
    assert whole(HermesCalls(new_id=counter()), text) == (content, calls)
    for got in every_chunking(lambda: HermesCalls(new_id=counter()), text):
        assert got == (content, calls)


def test_hermes_stream_shows_text_before_a_call_and_holds_the_call_until_it_closes():
    reader = HermesCalls(new_id=counter())
    assert reader.feed("Checking") == [Piece(content="Checking")]
    assert reader.feed(" now.\n<tool") == [Piece(content=" now.")]  # the tag's start is held, and the whitespace
    assert reader.feed('_call>\n{"name": "get_weather", "arguments": {"city": "Pa') == []
    assert not reader.called
    assert reader.feed('ris"}}\n</tool_call>') == [
        Piece(call={"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": ""}}),
        Piece(call={"index": 0, "function": {"arguments": '{"city": "Paris"}'}}),
    ]
    assert reader.called
    assert reader.feed("\n") == [] and reader.finish() == []  # whitespace after a call is dropped


def test_hermes_partial_tag_never_leaks_as_content():
    for cut in range(1, len("<tool_call>")):
        reader = HermesCalls()
        shown = reader.feed("Hi <tool_call>"[: 3 + cut])
        assert "".join(p.content for p in shown) == "Hi"


def test_hermes_with_one_call_allowed_keeps_the_first():
    content, calls = whole(HermesCalls(single=True, new_id=counter()), TWO_CALLS)
    assert content == "Let me check both." and calls == [call(0, "get_weather", CITY)]


ARRAY = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, {"name": "get_time", "parameters": {}}]'
ARRAY_CASES = [
    (ARRAY, "", [call(0, "get_weather", CITY), call(1, "get_time", {})]),
    ('  [ {"name": "f", "parameters": {"s": "]},{"}} ]  ', "", [call(0, "f", {"s": "]},{"})]),
    # cut short: the calls that closed, and no more
    ('[{"name": "f", "parameters": {}}, {"name": "g", "param', "", [call(0, "f", {})]),
    # no call at all: the text is the content
    ('[{"name": "f", "param', '[{"name": "f", "param', []),
    ("Sorry, I can't.", "Sorry, I can't.", []),
    ("[]", "[]", []),
    ("[1]", "[1]", []),
    # not a call ends the calls
    ('[{"name": "f", "parameters": {}} {"name": "g", "parameters": {}}]', "", [call(0, "f", {})]),
    ('[{"name": "f", "parameters": {}}, 7, {"name": "g", "parameters": {}}]', "", [call(0, "f", {})]),
]


@pytest.mark.parametrize("text,content,calls", ARRAY_CASES)
def test_array_whole_and_every_chunking_agree(text, content, calls):
    assert whole(ArrayCalls(new_id=counter()), text) == (content, calls)
    for got in every_chunking(lambda: ArrayCalls(new_id=counter()), text):
        assert got == (content, calls)


def test_array_gives_each_call_when_its_object_closes():
    reader = ArrayCalls(new_id=counter())
    assert reader.feed('[{"name": "f", "parameters": {"a": 1}') == []
    assert [p.call["function"] for p in reader.feed("}, ")] == [{"name": "f", "arguments": ""}, {"arguments": '{"a": 1}'}]
    assert reader.feed('{"name": "g", "parameters": {}}]') and reader.finish() == []


def test_array_with_one_call_allowed_keeps_the_first():
    assert whole(ArrayCalls(single=True, new_id=counter()), ARRAY) == ("", [call(0, "get_weather", CITY)])


def test_named_call_streams_the_output_as_its_arguments():
    reader = NamedCall("get_weather", new_id=counter())
    assert reader.feed('{"city"') == [
        Piece(call={"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": ""}}),
        Piece(call={"index": 0, "function": {"arguments": '{"city"'}}),
    ]
    assert reader.feed("") == []
    assert reader.feed(': "Paris"}') == [Piece(call={"index": 0, "function": {"arguments": ': "Paris"}'}})]
    assert reader.finish() == []
    text = '{"city": "Paris"}'
    for got in every_chunking(lambda: NamedCall("get_weather", new_id=counter()), text):
        assert got == ("", [{"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": text}}])


def test_named_call_with_no_output_is_still_the_call():
    reader = NamedCall("f", new_id=counter())
    assert [p.call["function"] for p in reader.finish()] == [{"name": "f", "arguments": ""}]


def test_call_ids_are_openai_style_and_distinct():
    _, calls = whole(HermesCalls(), TWO_CALLS)
    ids = [c["id"] for c in calls]
    assert all(i.startswith("call_") and len(i) > 10 for i in ids) and len(set(ids)) == 2


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "</tool", '{"name": "f", "arguments": {"a": 1}}', '{"name": "g"}', "{bad",
             "[", "]", ", ", '{"name": "h", "parameters": {}}', "text", " ", "\n", "<", "é", "}"]


@pytest.mark.parametrize("make", [lambda: HermesCalls(new_id=counter()), lambda: ArrayCalls(new_id=counter()),
                                  lambda: HermesCalls(single=True, new_id=counter())], ids=["hermes", "array", "hermes-single"])
def test_random_texts_read_the_same_in_every_chunking(make):
    rng = random.Random(7)
    for _ in range(150):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 12)))
        expected = whole(make(), text)
        for got in every_chunking(make, text, seed=rng.randint(0, 1000)):
            assert got == expected, text
