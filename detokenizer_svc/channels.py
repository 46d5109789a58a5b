"""A Harmony output read by channel (SamplingParams.channels: a chat of GPT-OSS), with
openai-harmony's StreamableParser, as vLLM's serving_chat reads gpt-oss (its harmony_utils and
stream_harmony): the parser is fed every output token; a header's tokens (`<|start|>assistant`,
`<|channel|>analysis`, ` to=functions.get_weather`, `<|message|>`) give no text, a content token
gives its text under the message's channel and recipient. Consecutive tokens of one message are
joined into one ChannelText, so an output of one step carries a few pieces, not one per token.

A token the parser refuses (the model left the format) ends the reading by channel: that token
and every later one go out as plain text (channel ""), which the gateway shows as content, so the
client sees what the model wrote rather than an error.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from jaxstream.protocol import ChannelText

log = logging.getLogger(__name__)


class Channels:
    def __init__(self, encoding: Any) -> None:
        from openai_harmony import Role, StreamableParser

        self.encoding = encoding
        self.parser: Any = StreamableParser(encoding, role=Role.ASSISTANT)  # None once the output left the format
        self.plain: list[int] = []  # tokens after the format was left, not decoded yet (a character may span several)

    def feed(self, token_ids: Sequence[int], last: bool = False) -> tuple[ChannelText, ...]:
        """The text these tokens add, by message; `last`: the output ends with them."""
        pieces: list[ChannelText] = []
        for token in token_ids:
            if self.parser is None:
                self.plain.append(token)
                continue
            try:
                self.parser.process(token)
            except Exception as exc:  # openai_harmony.HarmonyError
                log.info("a Harmony output left the format at token %d (%s): the rest is plain text", token, exc)
                self.parser = None
                self.plain.append(token)
                continue
            if text := self.parser.last_content_delta:
                self._add(pieces, ChannelText(len(self.parser.messages), self.parser.current_channel or "",
                                              self.parser.current_recipient or "", text))
        if self.plain:
            self._add(pieces, ChannelText(-1, "", "", self._plain(last)))
        return tuple(p for p in pieces if p.text)

    def _plain(self, last: bool) -> str:
        """The plain tokens' text, whole characters only until the last output."""
        text = self.encoding.decode(self.plain)
        if not last and text.endswith("\ufffd"):
            return ""  # a character cut at the end: wait for its other bytes
        self.plain = []
        return text

    @staticmethod
    def _add(pieces: list[ChannelText], piece: ChannelText) -> None:
        if pieces and (pieces[-1].message, pieces[-1].channel, pieces[-1].recipient) == (piece.message, piece.channel, piece.recipient):
            pieces[-1] = ChannelText(piece.message, piece.channel, piece.recipient, pieces[-1].text + piece.text)
        else:
            pieces.append(piece)
