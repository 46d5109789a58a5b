"""The prompt-scoring window, shared by the scheduler (which positions to ask a step to score) and
the worker (which positions a step's seq scores): one rule, so they cannot drift apart.

A step that feeds positions [p0, end) of a sequence computes the logits at p0 .. end - 1. Position
q is predicted by the logits at q - 1, so the step can score q in [p0 + 1, end], where q = end is
the known token right after the step's tokens (the next prompt chunk's first, StepSeq.next_token).
Position 0 has no predictor: the step that starts the sequence scores it too (logprob NaN). Only
prompt positions are scored.
"""

from __future__ import annotations


def window(p0: int, end: int, prompt_len: int) -> range:
    """The prompt positions a step feeding [p0, end) can score."""
    return range(p0 + 1 if p0 else 0, min(end + 1, prompt_len))
