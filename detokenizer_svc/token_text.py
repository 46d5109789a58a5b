"""Each token's own text, for logprobs (`SamplingParams.logprob_texts`).

Not the streamed text (that is `incremental.py`): the text of one token alone, as OpenAI's
`logprobs.content[].token` shows it. A byte-level BPE token (GPT-2 style: SmolLM2, Llama 3, Qwen)
is a string over GPT-2's `bytes_to_unicode` alphabet, one character per byte; mapped back, its
bytes may be only part of a UTF-8 character. Then its text is the decode with U+FFFD where the
bytes are, and `raw` carries the bytes themselves, so a client can join the bytes of several
tokens into the character. Added and special tokens are their content string; other tokenizers
(SentencePiece, ...) give `decode([id])`.
"""

from __future__ import annotations

from typing import Any


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character map: printable bytes map to themselves, the others to 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return chars


BYTE_OF_CHAR = {c: b for b, c in bytes_to_unicode().items()}


def is_byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer's pre-tokenizer or decoder is ByteLevel (possibly inside a Sequence)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    for part in (getattr(backend, "decoder", None), getattr(backend, "pre_tokenizer", None)):
        if part is not None:
            state = part.__getstate__()
            if b'"ByteLevel"' in (state if isinstance(state, bytes) else str(state).encode()):
                return True
    return False


class TokenTexts:
    """token id -> (text, raw bytes or None), cached: one per detokenizer, shared by its requests."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self._byte_level = is_byte_level(tokenizer)
        self._cache: dict[int, tuple[str, bytes | None]] = {}  # bounded by the vocabulary

    def __call__(self, token_id: int) -> tuple[str, bytes | None]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._text(token_id)
        return found

    def _text(self, token_id: int) -> tuple[str, bytes | None]:
        if token_id < 0:  # not a token: nothing a worker should send, nothing to crash on
            return "", None
        if token_id in self._added:
            return self._added[token_id], None
        if self._byte_level:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if piece is None:  # beyond the tokenizer's vocabulary (a padded model vocabulary)
                return "", None
            if all(c in BYTE_OF_CHAR for c in piece):
                raw = bytes(BYTE_OF_CHAR[c] for c in piece)
                try:
                    return raw.decode("utf-8"), None
                except UnicodeDecodeError:
                    return raw.decode("utf-8", errors="replace"), raw
        return self._tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False), None
