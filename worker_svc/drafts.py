"""Verifying a draft (speculative decoding, protocol.StepSeq.drafts): which sampled rows a step keeps.

A seq with a draft d_1 .. d_k samples k + 1 rows: row j draws the token at the position after its
j-th token (its first token's, then d_1's, ..), with the randomness of that position, as decoding
one token at a time would. Row j's token is the request's next token only if every draft token
before it was: the rows are kept up to and including the first whose token differs from the draft
token at its position (all k + 1 when none does).

This is the standard rejection rule for a draft that proposes one token with certainty (n-gram
drafts): a draft token d is accepted with probability p(d), the target model's, and on rejection
the token is drawn from p without d, renormalized. Drawing x ~ p and accepting d when x == d does
exactly that, and keeps x either way. So the tokens a request gets are the ones it would get
without a draft: equal for greedy rows and for a seeded request's sampled ones (each position's
randomness is keyed by seed and position, layers/sampling.py), and distributed alike for the rest.
"""

from __future__ import annotations

import numpy as np

from jaxstream.arrays import from_wire
from jaxstream.protocol import Step


def accepted(draft: np.ndarray, sampled: np.ndarray) -> int:
    """How many leading draft tokens [k] the rows' tokens [k + 1] confirm."""
    differs = np.flatnonzero(np.asarray(sampled[: len(draft)]) != np.asarray(draft))
    return int(differs[0]) if len(differs) else len(draft)


def kept_rows(step: Step, row_seqs: list[int], tokens: np.ndarray) -> np.ndarray | None:
    """[N] bool over a step's sampled rows (row_seqs: each row's index in step.seqs; tokens [N]
    their sampled tokens): False for the rows past each draft's first differing token. None when no
    seq has a draft (every row is kept)."""
    if not any(seq.drafts for seq in step.seqs):
        return None
    fed = from_wire(step.tokens)
    keep = np.ones(len(row_seqs), bool)
    r = 0
    while r < len(row_seqs):
        seq = step.seqs[row_seqs[r]]
        if seq.drafts:  # its drafts + 1 rows follow each other
            end = seq.start + seq.num_tokens
            n = accepted(fed[end - seq.drafts : end], tokens[r : r + seq.drafts + 1])
            keep[r + n + 1 : r + seq.drafts + 1] = False
            r += seq.drafts + 1
        else:
            r += 1
    return keep
