"""A model's thinking split from its answer, as vLLM's and SGLang's reasoning parsers split it
(model.reasoning_parser): the thinking goes to the message's `reasoning_content` (and `reasoning`,
vLLM's newer name: its DeltaMessage carries both), the answer to `content`, and only the answer is
read for tool calls.

"qwen3" and "deepseek_r1" read `<think>...</think>` (vLLM's reasoning/qwen3_reasoning_parser.py and
deepseek_r1_reasoning_parser.py, over basic_parsers.py's BaseThinkingReasoningParser); "openai_gptoss",
GPT-OSS's analysis channel, is read from the tokens by openai-harmony instead (gateway/harmony.py):
- the text before the first `</think>` is the thinking, less a `<think>` it opens with (the model
  writes it, or the template put it in the prompt: both are read alike);
- the text after it is the answer (none when empty);
- an output without `</think>` is all thinking (cut short, or the template opened the thinking and
  the model never closed it);
- "qwen3" with chat_template_kwargs `enable_thinking: false`: Qwen3's template closes an empty
  thinking in the prompt, so the whole output is the answer (vLLM's stream takes it so, seeing the
  prompt end the thinking; its whole response would still split at a `</think>`: here both are as its
  stream). The template's own test is kept: only `false` itself turns thinking off.
A constrained output (a forced tool call, a response_format) is all answer: the constraint holds
from the first token, so the model writes no thinking (vLLM lets it think first and constrains what
follows `</think>`; not built here).

`Thinking` reads one output in any chunking, holding back only a tail that may begin a tag, so a
tag split over two outputs is still found and the stream adds up to the whole response.
`Reading` puts the tool-call reader behind it: a choice's output into reasoning, content and calls.
"""

from __future__ import annotations

import json

from gateway.messages import template_kwargs
from gateway.tool_parser import Calls, Piece, joined, partial_tag

OPEN, CLOSE = "<think>", "</think>"


def thinks(parser: str | None, body: dict) -> bool:
    """Whether the outputs of a request (`body`) are read for thinking: a model with a reasoning
    parser, unless Qwen3's template was told not to think. Its chat_template_kwargs are checked here
    too (a 400 naming the field), whichever the route reads first."""
    kwargs = template_kwargs(body)
    told = json.loads(kwargs).get("enable_thinking") if kwargs else None
    return parser is not None and not (parser == "qwen3" and told is False)


class Thinking:
    """`[<think>] thinking </think> answer`, piece by piece: Piece(reasoning=...) then Piece(content=...)."""

    def __init__(self) -> None:
        self.buffer = ""  # text not given yet: the output's start (whitespace, part of OPEN), or a tail that may begin CLOSE
        self.state = "start"  # "start" (an opening OPEN may come), "thinking", "answer"

    def feed(self, text: str) -> list[Piece]:
        if self.state == "answer":
            return [Piece(content=text)] if text else []
        self.buffer += text
        if self.state == "start":
            head = self.buffer.lstrip()
            if OPEN.startswith(head) and head != OPEN:
                return []  # whitespace, or OPEN's beginning: not told yet
            if head.startswith(OPEN):
                self.buffer = head[len(OPEN):]
            self.state = "thinking"
        end = self.buffer.find(CLOSE)
        if end >= 0:
            thought, answer = self.buffer[:end], self.buffer[end + len(CLOSE):]
            self.buffer, self.state = "", "answer"
            return ([Piece(reasoning=thought)] if thought else []) + ([Piece(content=answer)] if answer else [])
        keep = partial_tag(self.buffer, CLOSE)
        thought, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return [Piece(reasoning=thought)] if thought else []

    def finish(self) -> list[Piece]:
        """What was held: thinking still (a `</think>` cut short is no end of it)."""
        held, self.buffer = self.buffer, ""
        return [Piece(reasoning=held)] if held else []


class Reading:
    """One choice's output into reasoning, content and tool calls: the thinking reader (None: the
    model's output has none), then the tool-call reader (None: no calls read) on the answer."""

    def __init__(self, thinking: Thinking | None, calls: Calls | None) -> None:
        self.thinking, self.calls = thinking, calls

    @property
    def called(self) -> bool:
        return self.calls is not None and self.calls.called

    @property
    def plain(self) -> bool:
        """Nothing to read: the output is the answer as it comes."""
        return self.thinking is None and self.calls is None

    def feed(self, text: str) -> list[Piece]:
        return self._answer(self.thinking.feed(text) if self.thinking else [Piece(content=text)] if text else [])

    def finish(self) -> list[Piece]:
        pieces = self._answer(self.thinking.finish() if self.thinking else [])
        return pieces + (self.calls.finish() if self.calls else [])

    def _answer(self, pieces: list[Piece]) -> list[Piece]:
        if self.calls is None:
            return pieces
        out: list[Piece] = []
        for piece in pieces:
            out += self.calls.feed(piece.content) if piece.content is not None else [piece]
        return out

    def whole(self, text: str) -> tuple[dict, bool]:
        """A whole output as the message's fields, and whether it called. With thinking, empty
        reasoning or content is null, as vLLM's; without, ToolUse.answer's fields."""
        pieces = self.feed(text) + self.finish()
        content, calls = joined(pieces)
        message: dict = {"content": content or None} if self.thinking or calls else {"content": content}
        if calls:
            message["tool_calls"] = calls
        if self.thinking:
            reasoning = "".join(p.reasoning for p in pieces if p.reasoning is not None) or None
            message |= {"reasoning": reasoning, "reasoning_content": reasoning}
        return message, bool(calls)


    def deltas(self, text: str, finished: bool) -> list[dict]:
        """The deltas (one per chunk) a piece of the streamed output gives."""
        return [delta(p) for p in self.feed(text) + (self.finish() if finished else [])]


def delta(piece: Piece) -> dict:
    """A piece as a chat chunk's delta."""
    if piece.reasoning is not None:
        return {"reasoning": piece.reasoning, "reasoning_content": piece.reasoning}
    return {"content": piece.content} if piece.content is not None else {"tool_calls": [piece.call]}
