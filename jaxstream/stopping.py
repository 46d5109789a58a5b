"""The finish rule, shared so the scheduler and the detokenizer reach the same verdict on the
same token (or, for a request that asks for none, on its fed prompt) without waiting for each other
(the detokenizer sits one Redis hop from the worker; asking the scheduler would add a hop to every token).

Stop strings are not here: only the detokenizer sees text, and it tells the scheduler.
"""

from __future__ import annotations

from jaxstream.protocol import FinishReason, FinishRule


def finish_reason(token_id: int, generated: int, rule: FinishRule) -> FinishReason | None:
    """Whether `token_id`, the `generated`-th output token (1-based), ends its request."""
    if token_id in rule.stop_token_ids and generated >= rule.min_new_tokens:
        return FinishReason("stop", matched=token_id)
    if generated >= rule.max_new_tokens:
        return FinishReason("length", length=generated)
    return None


def prefill_only(rule: FinishRule) -> FinishReason | None:
    """How a request that asked for no token ends (max_new_tokens 0, SGLang's prefill-only request,
    its way to score a prompt): as soon as its whole prompt is fed, with length 0, as SGLang reports
    it. None for a request that samples. No step samples for one that does not: a token nobody asked
    for would only be dropped. The detokenizer ends it on its last prompt position's score, or on
    the scheduler's word when it scores none (it has no other result)."""
    return FinishReason("length", length=0) if rule.max_new_tokens <= 0 else None
