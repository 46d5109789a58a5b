"""The bound on a prompt's characters that needs no tokenizer: a context of max_model_len tokens
holds at most max_model_len * server.max_chars_per_token characters (jaxstream/config/server.py
says why that is safe). A longer prompt cannot fit whatever its tokens, so it is refused before
anyone spends time tokenizing it: a text prompt by the gateway, a chat's rendered text by the
tokenizer. Both refuse in these words, with OpenAI's code for an overflow."""

from __future__ import annotations

from jaxstream.english import counted

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code for a prompt the context cannot hold


def too_long(chars: int, max_model_len: int, chars_per_token: int) -> str | None:
    """Why a prompt of `chars` characters cannot fit a context of `max_model_len` tokens; None when it may."""
    most = max_model_len * chars_per_token
    if chars <= most:
        return None
    # "maximum context length is": vLLM's phrase, which clients match to tell an overflow
    return (f"This model's maximum context length is {counted(max_model_len, 'token')}, which hold at most "
            f"{counted(most, 'character')} ({chars_per_token} a token, server.max_chars_per_token); the prompt has "
            f"{counted(chars, 'character')}, so it cannot fit (set truncate_prompt_tokens to keep what fits)")
