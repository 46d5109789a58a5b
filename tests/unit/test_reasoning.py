"""gateway/reasoning.py: the thinking split from the answer as vLLM's qwen3 and deepseek_r1 reasoning
parsers split it, whole and streamed in any chunking (a tag split over two outputs still found), and
only the answer read for tool calls."""

from __future__ import annotations

import pytest

from gateway.reasoning import Reading, Thinking, thinks
from gateway.tool_parser import HermesCalls, Piece
from gateway.tool_syntaxes import MistralCalls
from tests.unit.test_tool_parser import call, chunked, counter, every_chunking


def split(make, text: str, sizes=(1,)) -> tuple[str | None, str, list[dict]]:
    """(reasoning, content, calls) of `text` fed in chunks of `sizes`."""
    pieces, (content, calls) = chunked(make, text, sizes)
    return "".join(p.reasoning for p in pieces if p.reasoning is not None) or None, content, calls


def thinking() -> Reading:
    return Reading(Thinking(), None)


# Recorded Qwen3 and DeepSeek-R1-Distill outputs (and the edges vLLM's parsers name): text -> (reasoning, content)
CASES = [
    ("<think>\nThe user greets me.\n</think>\n\nHello! How can I help?", "\nThe user greets me.\n", "\n\nHello! How can I help?"),
    # DeepSeek-R1's template opens <think> in the prompt: the output starts inside the thinking
    ("Paris is in France.\n</think>\n\nParis.", "Paris is in France.\n", "\n\nParis."),
    # no </think>: all thinking (cut short by max_tokens)
    ("<think>\nLet me count: 1, 2", "\nLet me count: 1, 2", ""),
    ("Let me count", "Let me count", ""),
    # generation stopped right after the thinking: no content
    ("<think>so</think>", "so", ""),
    # whitespace before <think> goes with it; a later <think> is text of the thinking
    ("\n<think>a<think>b</think>c", "a<think>b", "c"),
    # only the first </think> ends the thinking
    ("a</think>b</think>c", "a", "b</think>c"),
    # a start of a tag that never completes is text
    ("<thi", "<thi", ""),
    ("a</thi", "a</thi", ""),
    ("", None, ""),
]


@pytest.mark.parametrize("text,reasoning,content", CASES)
def test_every_chunking_splits_as_the_whole_output(text, reasoning, content):
    for sizes in ([1], [len(text) or 1], [2, 3], [5, 1, 7]):
        assert split(thinking, text, sizes) == (reasoning or None, content, [])
    message, called = thinking().whole(text)
    assert message == {"content": content or None, "reasoning": reasoning or None, "reasoning_content": reasoning or None}
    assert not called


def test_a_tag_split_over_two_outputs_is_held_back_then_recognized():
    reader = Thinking()
    assert reader.feed("<thi") == []  # might open the thinking: nothing shown yet
    assert reader.feed("nk>Hmm, ") == [Piece(reasoning="Hmm, ")]
    assert reader.feed("yes.</th") == [Piece(reasoning="yes.")]  # "</th" held: it may end the thinking
    assert reader.feed("ink>Yes") == [Piece(content="Yes")]
    assert reader.feed(" indeed") == [Piece(content=" indeed")]  # past the thinking, text goes as it comes
    assert reader.finish() == []


def test_only_the_answer_is_read_for_tool_calls():
    text = ('<think>\nI could write <tool_call>{"name": "f", "arguments": {}}</tool_call> here.\n</think>\n\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    reading = lambda: Reading(Thinking(), HermesCalls(new_id=counter()))  # noqa: E731
    thought = '\nI could write <tool_call>{"name": "f", "arguments": {}}</tool_call> here.\n'
    for sizes in ([1], [len(text)], [3, 8]):
        assert split(reading, text, sizes) == (thought, "", [call(0, "get_weather", {"city": "Paris"})])
    message, called = reading().whole(text)
    assert called and message == {"content": None, "tool_calls": [call(0, "get_weather", {"city": "Paris"})],
                                  "reasoning": thought, "reasoning_content": thought}
    mistral = "Think first.</think>[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"a\": 1}}]"
    reasoning, content, calls = split(lambda: Reading(Thinking(), MistralCalls(new_id=counter())), mistral, (4,))
    assert (reasoning, content, calls) == ("Think first.", "", [call(0, "f", {"a": 1})])


def test_without_thinking_the_reading_is_the_tool_readers_own():
    assert Reading(None, None).whole("") == ({"content": ""}, False)  # as before: an empty answer is "", not null
    assert Reading(None, HermesCalls()).whole("<think>x</think> y") == ({"content": "<think>x</think> y"}, False)
    for got in every_chunking(lambda: Reading(None, HermesCalls(new_id=counter())), 'a<tool_call>{"name": "f"}</tool_call>'):
        assert got == ("a", [call(0, "f", {})])


def test_which_requests_are_read_for_thinking():
    assert not thinks(None, {})
    assert thinks("deepseek_r1", {}) and thinks("qwen3", {}) and thinks("qwen3", {"chat_template_kwargs": {"enable_thinking": True}})
    # Qwen3's template closes the thinking in the prompt when told not to think: the output is the answer
    assert not thinks("qwen3", {"chat_template_kwargs": {"enable_thinking": False}})
    assert thinks("deepseek_r1", {"chat_template_kwargs": {"enable_thinking": False}})  # not its template's switch
    assert thinks("qwen3", {"chat_template_kwargs": {"enable_thinking": None}})  # the template's own test: `is false`
