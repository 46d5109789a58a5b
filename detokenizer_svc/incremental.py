"""Incremental detokenization: token ids in, newly completed text out.

Byte-level BPE splits characters across tokens, and `decode` renders an unfinished character as
U+FFFD. Decoding everything on every token would fix that at a cost that grows with the output;
decoding each token alone would stream broken characters. So, as vLLM does, we decode a short
window of recent ids:

    ids:  ... | prefix ........ read ........ end
                 already sent    not yet sent
                 (context only)

    new text = decode(ids[prefix:end])[len(decode(ids[prefix:read])):]

The context tokens make the window decode the new tokens as the full decode would (leading
spaces, merged bytes). The new text is sent once it does not end in U+FFFD; then `prefix`
moves to `read` and `read` to `end`. Invariants: `prefix` and `read` sit on character
boundaries of the full decode, and everything before `read` has been sent.

A trailing U+FFFD is held only while it may still be an unfinished character: a character is
at most 4 bytes, so once more than MAX_PENDING tokens wait we look for the last token boundary
that no character crosses and send everything before it. That keeps the window bounded even
when a model emits a long run of invalid bytes.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"
MAX_PENDING = 4  # unsent tokens tolerated behind a trailing U+FFFD (a UTF-8 character is <= 4 bytes)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Ids that decode drops: kept out of the window, where as zero-byte tokens they could sit
        # between the bytes of one character and hide every boundary (see _last_boundary).
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self._dropped = {i for i, t in added.items() if t.special} if skip_special_tokens else set()
        self._ids: list[int] = []  # only the window: ids before `prefix` are dropped
        self._prefix = 0
        self._read = 0
        self.max_window = 0  # the most ids passed to one decode call, for tests of the cost bound

    def push(self, token_ids: list[int]) -> str:
        """Append ids; return the text they complete (possibly "")."""
        self._ids.extend(i for i in token_ids if i not in self._dropped)
        sent = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        if not text.endswith(REPLACEMENT):
            return self._advance(len(self._ids), sent, text)
        if len(self._ids) - self._read > MAX_PENDING:
            boundary = self._last_boundary(text)
            if boundary is not None:
                end, head = boundary
                return self._advance(end, sent, head)
        return ""

    def finish(self) -> str:
        """Return whatever was held back, an unfinished character as decode renders it.
        Called once, at the end of the request."""
        sent = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        return self._advance(len(self._ids), sent, text)

    def _advance(self, end: int, sent: str, text: str) -> str:
        """Send text[len(sent):], the window's text up to id `end`; slide the window."""
        self._prefix, self._read = self._read, end
        del self._ids[: self._prefix]  # keep memory bounded too
        self._read -= self._prefix
        self._prefix = 0
        return text[len(sent) :]

    def _last_boundary(self, text: str) -> tuple[int, str] | None:
        """The last unsent id index that no character crosses, with the window text before it.

        A split is clean iff decoding the two sides apart gives the same text as decoding them
        together: a character (or invalid byte run) crossing it would decode as two or more.
        Bytes that come later cannot change a clean split whose right side holds text (an empty
        right side could still be crossed by them), so the text before it is final.
        """
        for split in range(len(self._ids) - 1, self._read, -1):
            head = self._decode(self._prefix, split)
            tail = self._decode(split, len(self._ids))
            if tail and head + tail == text:
                return split, head
        return None

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        self.max_window = max(self.max_window, end - start)
        # No clean-up of spaces: it rewrites text already sent (" ." -> ".").
        return self._tokenizer.decode(
            self._ids[start:end],
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
