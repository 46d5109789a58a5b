"""The finish rule, shared so the scheduler and the detokenizer reach the same verdict on the
same token without waiting for each other (the detokenizer sits one Redis hop from the worker;
asking the scheduler would add a hop to every token).

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

