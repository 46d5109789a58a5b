"""scheduler -> detokenizer: which requests start (with what the detokenizer needs of them), which
the scheduler ended, and which took prompt tokens from the prefix cache."""

from __future__ import annotations

import msgspec

from jaxstream.protocol.request import FinishReason, FinishRule


class RequestStart(msgspec.Struct, frozen=True, array_like=True):
    rid: str
    gateway: str
    prompt_tokens: int
    stop: tuple[str, ...]
    finish: FinishRule
    skip_special_tokens: bool = True
    top_logprobs: int = 0  # alternatives to pass on per token
    logprob_texts: bool = False  # give each returned token its text
    no_stop_trim: bool = False  # a matched stop string stays in the text
    replica: int = 0  # the scheduler's replica: a stop string's finish goes back to it
    # The request's results are those of its replica's steps from this id on. With overlap a step
    # in flight may still sample for an ended request of the same rid (a client retrying it): the
    # detokenizer must not give that token to this one.
    first_step: int = 0
    # The first position of the routed experts the request asked for (its routed_experts_start_len);
    # -1: it asked for none. The detokenizer gathers them and sends them with the last output.
    routed_experts_from: int = -1
    token_ids_logprob: tuple[int, ...] = ()  # the ids whose logprobs come with every token (SamplingParams)
    stop_regex: tuple[str, ...] = ()  # patterns that finish the output, as `stop` (SamplingParams)
    prompt_ids: tuple[int, ...] = ()  # the prompt, when the request asked for its ids back
    prompt_top_logprobs: int = -1  # alternatives per scored prompt position (SamplingParams'); -1: top_logprobs
    channels: bool = False  # parse the output by Harmony's channels (SamplingParams.channels)


class RequestEnd(msgspec.Struct, frozen=True, array_like=True):
    """The scheduler ended a request for a reason the detokenizer cannot see (abort, error)."""

    rid: str
    gateway: str
    finish: FinishReason


class CacheHit(msgspec.Struct, frozen=True, array_like=True):
    """A request's first step took its first `cached_tokens` prompt tokens from the prefix cache."""

    rid: str
    cached_tokens: int


class RequestEvents(msgspec.Struct, frozen=True, tag=True):
    """Batched per scheduler iteration. Starts are sent before the request's first step, cache hits
    with it (before its first result)."""

    started: tuple[RequestStart, ...] = ()
    ended: tuple[RequestEnd, ...] = ()
    cache_hits: tuple[CacheHit, ...] = ()


DetokenizerInput = RequestEvents
