"""-> gateway: a request's output (detokenizer), its refusal (tokenizer, scheduler), the answers
to (de)tokenization and to control messages."""

from __future__ import annotations

import msgspec

from jaxstream.protocol.control import ControlReply, FlushCacheReply
from jaxstream.protocol.request import FinishReason, TokenLogprob
from jaxstream.protocol.wire import Array


class ChannelText(msgspec.Struct, frozen=True, array_like=True):
    """New text of one message of a Harmony output (SamplingParams.channels), as openai-harmony's
    StreamableParser reads the tokens: the header's tokens give none, each content token its text."""

    message: int  # which message of the output, from 0: a new one is a new call even to the same function
    channel: str  # "analysis", "commentary", "final"; "" when the output stopped being Harmony (its text as decoded)
    recipient: str  # "functions.NAME" for a call; "" for none
    text: str


class RequestOutput(msgspec.Struct, frozen=True, omit_defaults=True):
    """New output of one request since its previous RequestOutput."""

    rid: str
    text: str = ""  # new text, never a broken UTF-8 character, never part of a possible stop string
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    finish: FinishReason | None = None  # set exactly once, on the last output
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    token_texts: tuple[str, ...] = ()  # each of token_ids' own text, when the request asked for texts
    # With token_texts, when some token is only part of a UTF-8 character: each token's bytes (None
    # for one whose text is whole), as TokenLogprob.raw. () when every token's text is whole.
    token_raws: tuple[bytes | None, ...] = ()
    top_logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()  # per token of token_ids, best first
    # Prompt logprobs, all of them in the request's first output: positions prompt_logprobs_from on
    # (SamplingParams), each with its alternatives in prompt_top_logprobs when asked.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    prompt_top_logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()
    cached_tokens: int = 0  # prompt tokens read from the prefix cache (SGLang's cached_tokens)
    weight_version: str = ""  # of the weights that computed token_ids (one step's: one version)
    # On the last output of a request that asked (RequestStart.routed_experts_from): [n, L, k] int32,
    # the routed experts of positions [from, prompt + completion tokens - 1), or of as many of them
    # as ran before the request ended (an abort). The last sampled token never ran: no row.
    routed_experts: Array | None = None
    # Per token of token_ids, the logprobs of the request's token_ids_logprob, in its order.
    token_ids_logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()
    # With prompt_logprobs (first output): per prompt position, the same; and each prompt token's rank.
    prompt_token_ids_logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()
    prompt_ranks: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()  # the whole prompt, on the first output, when asked (return_prompt_token_ids)
    # The request's outputs count from 1, so the gateway sees one lost (a gap: the request fails)
    # or one delivered twice (dropped). 0: the end of a request its detokenizer no longer held.
    seq: int = 0
    # With SamplingParams.channels: `text`'s tokens read by Harmony's channels, in order (consecutive
    # tokens of one message joined). `text` stays the plain decoding.
    channels: tuple[ChannelText, ...] = ()


class OutputBatch(msgspec.Struct, frozen=True, tag=True):
    """One message per step per gateway."""

    outputs: tuple[RequestOutput, ...]


class RequestRejected(msgspec.Struct, frozen=True, tag=True):
    """A request refused before it produced any token; reaches the client as an HTTP error."""

    rid: str
    status: int  # HTTP status, 400 for validation
    message: str
    param: str | None = None
    code: str | None = None


class TokenizeReply(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """The answer to a TokenizeRequest (token_ids) or a DetokenizeRequest (text)."""

    rid: str
    token_ids: tuple[int, ...] = ()
    text: str | None = None
    token_strs: tuple[str, ...] | None = None
    max_model_len: int = 0


GatewayInput = OutputBatch | RequestRejected | TokenizeReply | FlushCacheReply | ControlReply
