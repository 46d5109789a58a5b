"""Which prompt positions a StepSeq scores (protocol.StepSeq.score_from), for both engines.

A seq feeds positions [p0, context_len); of the window its logits can score (jaxstream.scoring), it
scores those from score_from on: q >= 1 through a predictor (the target of q is the fed token at q,
or for q = context_len StepSeq.next_token), and position 0 (logprob NaN) when the window holds it.
"""

from __future__ import annotations

import numpy as np

from jaxstream.protocol import StepSeq
from jaxstream.scoring import window


def first_position(seq: StepSeq) -> int:
    """p0: the position of the seq's first token in this Step."""
    return seq.context_len - seq.num_tokens


def scored(seq: StepSeq) -> range:
    """The positions q >= 1 the Step scores for the seq (empty when it scores none). The one after
    the Step's tokens needs next_token: without it (a scheduler bug) it is left out."""
    if seq.score_from < 0:
        return range(0)
    can = window(first_position(seq), seq.context_len, seq.prompt_len)
    end = seq.context_len if can.stop > seq.context_len and seq.next_token < 0 else can.stop
    return range(max(seq.score_from, can.start, 1), end)


def predicted_by(seq: StepSeq, first: int, count: int) -> range:
    """The positions of `scored(seq)` predicted by the fed tokens at [first, first + count): q - 1 among them."""
    every = scored(seq)
    return range(max(every.start, first + 1), min(every.stop, first + count + 1))


def token_at(seq: StepSeq, fed: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The token at each position q in [p0, context_len]: the fed token, or for q = context_len
    next_token (the target of the Step's last scored position). `fed`: the seq's tokens in this Step."""
    return np.append(fed, seq.next_token)[q - first_position(seq)]


def scores_position_zero(seq: StepSeq) -> bool:
    return seq.score_from == 0 and 0 in window(first_position(seq), seq.context_len, seq.prompt_len)
