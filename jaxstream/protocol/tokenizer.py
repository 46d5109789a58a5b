"""gateway -> tokenizer: a client's request before tokenization, and (de)tokenization asked alone."""

from __future__ import annotations

import msgspec

from jaxstream.protocol.request import ChatMessage, SamplingParams


class GenerateRequest(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """A client request, before tokenization. Exactly one of text, messages, input_ids is set."""

    rid: str
    gateway: str  # the gateway instance whose stream receives every reply
    sampling: SamplingParams
    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    input_ids: tuple[int, ...] | None = None
    add_special_tokens: bool = True  # for `text`; chat templates carry their own
    replica: int = 0  # the data-parallel replica the gateway chose: its scheduler gets the request
    # sampling.max_new_tokens as the client named it (max_completion_tokens, sampling_params.max_new_tokens,
    # ...): a refusal names the field the client sent
    max_tokens_name: str = "max_tokens"
    # vLLM's truncate_prompt_tokens: keep only the prompt's last k tokens (-1: as many as the context
    # holds); None: never truncate (a prompt too long is refused).
    truncate_prompt_tokens: int | None = None
    # For `messages` (vLLM's names): open an assistant turn after them, or continue the last
    # message (the assistant's, unfinished: no end-of-turn token after it). At most one of them.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    truncate_left: bool = True  # truncate_prompt_tokens keeps the prompt's end (vLLM's truncation_side "left"), else its start
    # For `messages`: OpenAI's `tools` (a JSON array of {"type": "function", "function": {...}}),
    # rendered by the chat template, or described in a system message when the template has no
    # place for them. None: no tools.
    tools: str | None = None
    # For `messages`: vLLM's chat_template_kwargs, a JSON object of extra variables for the chat
    # template (Qwen3's {"enable_thinking": false}); the gateway refused the names the template's
    # call sets itself. None: none.
    chat_template_kwargs: str | None = None
    # For `messages` of a Harmony model (GPT-OSS): the function a named tool_choice forces. The prompt
    # ends with that call's header, so the output is its arguments (the constraint's). None: none.
    forced_call: str | None = None


class TokenizeRequest(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """/tokenize: text, or chat messages rendered with the chat template, to ids. Answered with a
    TokenizeReply (or a RequestRejected) on the gateway's stream."""

    rid: str
    gateway: str
    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True  # for messages
    token_strs: bool = False  # also return each id's token string
    continue_final_message: bool = False  # for messages: leave the last one open (GenerateRequest's)
    tools: str | None = None  # for messages: GenerateRequest's
    chat_template_kwargs: str | None = None  # for messages: GenerateRequest's


class DetokenizeRequest(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """/detokenize, and the text of a token-id prompt for `echo`."""

    rid: str
    gateway: str
    token_ids: tuple[int, ...]
    skip_special_tokens: bool = True


TokenizerInput = GenerateRequest | TokenizeRequest | DetokenizeRequest
