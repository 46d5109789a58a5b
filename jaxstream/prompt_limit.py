"""The bound on a prompt's characters that needs no tokenizer: a context of max_model_len tokens
holds at most max_model_len * server.max_chars_per_token characters (jaxstream/config/server.py
says why that is safe). A longer prompt cannot fit whatever its tokens, so it is refused before
anyone spends time tokenizing it: a text prompt by the gateway, a chat's rendered text by the
tokenizer. Both refuse in these words, with OpenAI's code for an overflow.

Once the prompt's tokens are known, the tokenizer refuses an overflow in the words of the engine
whose route the request came by (`overflow`): clients of each match them by phrase."""

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


def overflow(max_model_len: int, prompt_tokens: int, wanted: int | None, field: str) -> str:
    """Why a prompt of `prompt_tokens` tokens asking for `wanted` more (None: as many as fit) does not
    fit a context of `max_model_len`, in the words of the engine whose dialect `field` (the client's
    spelling of its max tokens field) is: SGLang's for its `max_new_tokens` (/generate), vLLM's else.
    Only the words: which request overflows is the caller's rule."""
    total = prompt_tokens + (wanted or 0)
    if field.endswith("max_new_tokens"):  # SGLang's (managers/tokenizer_manager.py, _validate_one_request)
        if wanted is None or prompt_tokens >= max_model_len:
            return f"The input ({prompt_tokens} tokens) is longer than the model's context length ({max_model_len} tokens)."
        return (f"Requested token count exceeds the model's maximum context length of {max_model_len} tokens. You requested a "
                f"total of {total} tokens: {prompt_tokens} tokens from the input messages and {wanted} tokens for the "
                "completion. Please reduce the number of tokens in the input messages or the completion to fit within the limit.")
    # vLLM's (entrypoints/openai/engine/serving.py, OpenAIServing._validate_input)
    if wanted is None or prompt_tokens >= max_model_len:
        return (f"This model's maximum context length is {max_model_len} tokens. However, your request has {prompt_tokens} "
                "input tokens. Please reduce the length of the input messages.")
    named = "'max_tokens' or 'max_completion_tokens'" if field in ("max_tokens", "max_completion_tokens") else f"'{field}'"
    return (f"{named} is too large: {wanted}. This model's maximum context length is {max_model_len} tokens and your request "
            f"has {prompt_tokens} input tokens ({wanted} > {max_model_len} - {prompt_tokens}).")
