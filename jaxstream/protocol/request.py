"""The request's description, shared by several streams' messages: what the client asked for
(SamplingParams, with a Constraint), its chat messages, when it ends (FinishRule) and why it ended
(FinishReason), and a token with its logprob."""

from __future__ import annotations

import msgspec

# max_new_tokens when a client gives none, as each API documents it: OpenAI's completions 16
# (SamplingParams' own default), its chat completions up to the context length, SGLang's /generate 128.
CHAT_MAX_NEW_TOKENS: int | None = None
GENERATE_MAX_NEW_TOKENS = 128


class Constraint(msgspec.Struct, frozen=True, array_like=True):
    """What the output must match (constrained decoding): every sampled token keeps the output a
    prefix of a match, and the request's end-of-sequence token is allowed only once it is a whole
    one. The gateway reads the client's fields into one (jaxstream/grammar.py checks it); the worker
    turns it into a token mask per step."""

    kind: str  # "json_schema" (spec: the schema as JSON text), "regex", "lark" (a Lark grammar)
    spec: str


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the client asked for. Validated by the gateway; every field's default is here (the
    gateway's routes read them from here), and they are OpenAI's."""

    max_new_tokens: int | None = 16  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted once per time the token was generated
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids unique
    top_logprobs: int = 0  # most likely alternatives returned with each generated token, 0..server.max_logprobs
    # Prompt logprobs: -1 none; k >= 0: the logprob of every prompt token at position >= k, with
    # `top_logprobs` alternatives each. Position 0 is predicted by nothing: its logprob is NaN.
    prompt_logprobs_from: int = -1
    # Logprobs of the model's raw logits (temperature 1, no penalty or bias) instead of the default:
    # the distribution that sampled, after penalties, bias and temperature, before top-k/top-p/min-p.
    raw_logprobs: bool = False
    # The detokenizer attaches each returned token's own text to its logprobs.
    logprob_texts: bool = False
    no_stop_trim: bool = False  # keep a matched stop string at the end of the text (SGLang's no_stop_trim)
    # Logprobs of the fully processed distribution: the default's, then cut by top-k/top-p/min-p
    # (and min_tokens' ban) and renormalized over the tokens kept (vLLM's processed_logprobs).
    # Generated tokens only: a prompt token was not sampled, so it keeps the default's.
    processed_logprobs: bool = False
    # vLLM's allowed_token_ids: only these ids may be sampled, as if every other token had a logit
    # bias of -inf (so the default logprobs are over them). (): every token.
    allowed_token_ids: tuple[int, ...] = ()
    # SGLang's routed experts ("R3"): the MoE layers' chosen expert ids of every position the model
    # ran from routed_experts_start_len on (the prompt's, cached ones included, and each fed output
    # token's), returned with the request's last output. Needs worker.enable_return_routed_experts.
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0  # the first position returned, in [0, prompt tokens]
    # SGLang's token_ids_logprob: the logprobs of these ids (at most MAX_TOKEN_IDS_LOGPROB, unique) at
    # every position whose logprob comes back: each generated token's, and the prompt's from
    # prompt_logprobs_from on. Same distribution as the sampled token's logprob.
    token_ids_logprob: tuple[int, ...] = ()
    # SGLang's stop_regex: the output finishes (type stop, matched: the pattern) when one of these
    # Python regular expressions matches the output text (re.search), as a stop string does.
    stop_regex: tuple[str, ...] = ()
    # The prompt's token ids come back with the request's first output (vLLM's return_token_ids).
    return_prompt_token_ids: bool = False
    # Alternatives per scored prompt position; -1: top_logprobs (vLLM's prompt_logprobs asks for its
    # own count, so a request wanting only the prompt's does not pay for every sampled token's).
    prompt_top_logprobs: int = -1
    constraint: Constraint | None = None  # the output must match it (response_format, guided_*, json_schema, regex, ebnf)
    # The output is read by Harmony's channels (a chat of a Harmony model, GPT-OSS): the detokenizer
    # parses its tokens with openai-harmony and each output carries its text by channel
    # (RequestOutput.channels), which the gateway reads into reasoning, content and tool calls.
    channels: bool = False
    # The LoRA adapter the request runs under, by the name it was loaded with (the gateway checked it
    # is loaded; the scheduler resolves it to a device slot at admission, and ends the request with a
    # 404 when it was unloaded meanwhile). "": the base model.
    lora: str = ""

    def prompt_alternatives(self) -> int:
        return self.top_logprobs if self.prompt_top_logprobs < 0 else self.prompt_top_logprobs

    def uses_penalty(self) -> bool:
        """Whether sampling counts the request's earlier tokens (the worker then keeps their history)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def reads_output(self) -> bool:
        """Whether the worker must know every output token fed before (penalties count them, a
        constraint's matcher consumed them), so a step after a prefix cache hit brings them."""
        return self.uses_penalty() or self.constraint is not None


class ToolCall(msgspec.Struct, frozen=True, array_like=True):
    """A function call an assistant message made, as OpenAI's messages carry it."""

    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's
    tool_call_id: str | None = None  # a "tool" message: the call it answers
    name: str | None = None  # a "tool" message: the function's name
    reasoning: str | None = None  # an assistant's thinking sent back (vLLM's `reasoning`): a Harmony model's analysis


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One token with its logprob, and its text when asked (`SamplingParams.logprob_texts`)."""

    token_id: int
    logprob: float
    text: str | None = None
    # The token's bytes, only when they are not valid UTF-8 on their own (part of a character):
    # then `text` holds U+FFFD where the bytes are.
    raw: bytes | None = None


class FinishReason(msgspec.Struct, frozen=True, omit_defaults=True):
    """Why a request ended: `stop` (EOS, stop token or stop string), `length`, `abort` (asked for:
    a client, /abort_request, a pause) or `error` (the server failed it, e.g. its worker died: the
    gateway answers a 503, an SSE error event once streaming, never a finish_reason)."""

    type: str
    matched: int | str | None = None  # the stop token id or stop string, for `stop`
    length: int | None = None  # tokens generated, for `length`
    message: str | None = None  # for `abort` and `error`


class FinishRule(msgspec.Struct, frozen=True, array_like=True):
    """When a request ends by its tokens, resolved once by the tokenizer (`jaxstream.stopping` applies
    it): the scheduler and the detokenizer reach the same verdict on the same token."""

    stop_token_ids: tuple[int, ...]  # the client's, plus EOS unless ignore_eos
    max_new_tokens: int  # the client's, capped by the context length (None asked: all the room left)
    min_new_tokens: int = 0  # no stop token ends it (or is sampled) before this many tokens
