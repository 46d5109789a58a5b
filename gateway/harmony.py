"""A Harmony model's chat output (GPT-OSS; model.tool_parser "openai", model.reasoning_parser
"openai_gptoss") as OpenAI's message: the detokenizer reads its tokens by channel with
openai-harmony (RequestOutput.channels, asked by SamplingParams.channels), and this reads the
channels as vLLM's serving_chat reads gpt-oss's (its stream_harmony and harmony_utils):
- the analysis channel is `reasoning_content` (and `reasoning`);
- the final channel, and commentary with no recipient (a preamble the user is meant to see), is
  `content`;
- a message to `functions.NAME` (commentary, or analysis) is a call of NAME whose arguments are the
  message's text, streamed as it comes; each message is a call of its own, even to the same
  function (ChannelText.message tells them apart). With tool_choice "none" no call is read: such a
  message's text is content, as written. parallel_tool_calls false keeps the first call;
- a message to another recipient (a built-in tool: browser, python) is the model's own business:
  reasoning;
- text the detokenizer could not read by channel (the model left the format) is content.
Pieces come as gateway/tool_parser.py's, so whole and streamed responses add up alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from gateway.messages import template_kwargs
from gateway.params import check
from gateway.reasoning import delta
from gateway.tool_parser import Calls, Piece, joined, new_call_id
from jaxstream.protocol import ChannelText, ChatMessage

FUNCTIONS = "functions."
EFFORTS = ("low", "medium", "high")  # openai-harmony's ReasoningEffort


def harmony_kwargs(body: dict) -> str | None:
    """chat_template_kwargs for a Harmony model's renderer (tokenizer_svc/harmony_prompt.py), with the
    request's reasoning_effort in them, as gpt-oss's own template takes it."""
    kwargs = template_kwargs(body)
    effort = body.get("reasoning_effort")
    if effort is None:
        return kwargs
    check(effort in EFFORTS, "reasoning_effort", f"must be \"low\", \"medium\" or \"high\" for this model, got {effort!r}")
    return json.dumps((json.loads(kwargs) if kwargs else {}) | {"reasoning_effort": effort})


def harmony_turn(body: dict, messages: tuple[ChatMessage, ...]) -> dict:
    """The body as gateway/params.py's chat_continuation reads it for a Harmony model: a chat that
    ends with the assistant's message gets a new turn (Harmony closes every message it renders, as
    vLLM's gpt-oss chat does) unless the client sends continue_final_message, which the tokenizer
    refuses, naming it."""
    if body.get("continue_final_message") is None and messages[-1].role == "assistant":
        return body | {"continue_final_message": False}
    return body


class HarmonyReading:
    """One choice's channels into reasoning, content and tool calls (gateway/reasoning.py's Reading's
    interface, over ChannelText pieces instead of text)."""

    plain = False  # the output is read, never passed on as it comes

    def __init__(self, calls: bool, single: bool = False) -> None:
        self.calls = Calls(new_call_id) if calls else None  # None: tool_choice "none", no call is read
        self.single = single
        self.message = -1  # the output's message whose call is open (its arguments go on)

    @property
    def called(self) -> bool:
        return self.calls is not None and self.calls.called

    def feed(self, channels: Iterable[ChannelText]) -> list[Piece]:
        pieces: list[Piece] = []
        for piece in channels:
            if piece.recipient.startswith(FUNCTIONS) and self.calls is not None:
                pieces += self._call(piece)
            elif piece.recipient and not piece.recipient.startswith(FUNCTIONS) or piece.channel == "analysis":
                pieces.append(Piece(reasoning=piece.text))
            else:  # final, a preamble, plain text, or a call not read
                pieces.append(Piece(content=piece.text))
        return pieces

    def finish(self) -> list[Piece]:
        return []  # the detokenizer holds nothing back: every token's text came with it

    def _call(self, piece: ChannelText) -> list[Piece]:
        assert self.calls is not None
        if piece.message != self.message:  # a new message: a new call
            if self.single and self.calls.called:
                return []
            self.message = piece.message
            return self.calls.open(piece.recipient[len(FUNCTIONS):], piece.text)
        return self.calls.arguments(piece.text, self.calls.count - 1)

    def whole(self, channels: Iterable[ChannelText]) -> tuple[dict, bool]:
        """The whole output as the message's fields (empty reasoning or content null, as vLLM's), and
        whether it called."""
        pieces = self.feed(channels)
        content, calls = joined(pieces)
        reasoning = "".join(p.reasoning for p in pieces if p.reasoning is not None) or None
        message: dict = {"content": content or None, "reasoning": reasoning, "reasoning_content": reasoning}
        if calls:
            message["tool_calls"] = calls
        return message, bool(calls)

    def deltas(self, channels: Iterable[ChannelText], finished: bool) -> list[dict]:
        return [delta(p) for p in self.feed(channels)]
