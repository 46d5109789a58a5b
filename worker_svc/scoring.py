"""Prompt scoring: the logprobs of prompt tokens (prompt_logprobs, SGLang's input_token_logprobs),
their alternatives, the logprobs of a request's named ids (token_ids_logprob) and each token's rank.

`score` runs compiled, per tokens bucket, over the final hidden states of the positions a sub-step
scores (their predictors'): the LM head, then row by row (`Numerics.rowwise`) the same logprob rule
as sampling's (engine.py's docstring). `prompt_scores` reads its outputs back as one PromptScores
per seq of the step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxstream.arrays import from_wire, to_wire
from jaxstream.protocol import MAX_TOKEN_IDS_LOGPROB, MAX_TOP_LOGPROBS, PromptScores, SamplingParams, Step
from worker_svc.inputs import ScoreInputs
from worker_svc.layers.sampling import (MIN_TEMPERATURE, alternatives, gather_log_prob, log_prob, no_alternatives, normalizer,
                                        top_count)
from worker_svc.positions import scores_position_zero


def score(graph: nnx.GraphDef, params: nnx.State, hidden: jax.Array, s: ScoreInputs,
          width: int = MAX_TOP_LOGPROBS) -> tuple[jax.Array, ...]:
    """Prompt logprobs: hidden [T, D] -> (logprob of each entry's target [T], its alternatives'
    ids [T, A] and logprobs [T, A] (A = top_count(V, width)), zeros when no entry asked; the
    logprobs of its ids [T, I], zeros when none asked; its target's rank [T] i32)."""
    model = nnx.merge(graph, params)
    logits = model.head(jnp.take(hidden, s.at, axis=0))  # [T, V] f32
    rows = s.bias.shape[0]
    biased = lax.cond(jnp.any(s.bias_row < rows),
                      lambda: logits + jnp.take(s.bias, s.bias_row, axis=0, mode="fill", fill_value=0), lambda: logits)
    base = jnp.where(s.raw[:, None], logits, biased)
    t = jnp.where(s.raw | (s.temperature < MIN_TEMPERATURE), 1.0, s.temperature)[:, None]  # [T, 1]

    def entries(base, t, target, top, ids):  # row-wise: sums over the vocabulary
        peak, total = normalizer(base, t)
        log_total = jnp.log(total)
        logprobs = log_prob(jnp.take_along_axis(base, target[:, None], axis=-1), t, peak, log_total)[:, 0]
        top_ids, top_logprobs, logprobs = lax.cond(jnp.any(top),
                                                   lambda: alternatives(base, t, peak, log_total, target, top, logprobs, width),
                                                   lambda: (*no_alternatives(base.shape, width), logprobs))
        asked = ids < base.shape[-1]  # [T, I]
        ids_logprobs = lax.cond(jnp.any(asked), lambda: gather_log_prob(base, t, peak, log_total, ids),
                                lambda: jnp.zeros(ids.shape, jnp.float32))
        return logprobs, top_ids, top_logprobs, jnp.where(asked, ids_logprobs, 0.0), rank(log_prob(base, t, peak, log_total), target)

    return model.cfg.numerics.rowwise(entries, base, t, s.target, s.top, s.ids)


def rank(lp: jax.Array, target: jax.Array) -> jax.Array:
    """Each target's rank [T] i32 among the logprobs lp [T, V], as vLLM counts it: the tokens whose
    logprob is at least the target's (itself included; 1: the most likely). Read from the one array,
    so the comparison is exact."""
    own = jnp.take_along_axis(lp, target[:, None], axis=-1)  # [T, 1]
    return jnp.sum(lp >= own, axis=-1, dtype=jnp.int32)


class _Scores(NamedTuple):
    """One piece of a seq's prompt scores, read back: positions first, first + 1, ..."""

    first: int
    targets: np.ndarray  # [n] the tokens scored
    lps: np.ndarray  # [n]
    top_ids: np.ndarray | None  # [n, A]; None: no entry of the sub-step asked
    top_lps: np.ndarray | None  # [n, A]
    ids_lps: np.ndarray | None  # [n, I]: of token_ids_logprob; None: no entry asked
    ranks: np.ndarray  # [n] i32


def prompt_scores(step: Step, params: list[SamplingParams], scored: list, vocab: int,
                  top_width: int = MAX_TOP_LOGPROBS) -> tuple[PromptScores, ...]:
    """One PromptScores per seq that scored something, in step order, from each sub-step's `score`
    outputs read back: position 0 first (when asked: NaN, no alternatives, rank 0), then each
    sub-step's entries in order, contiguous. `top_width`: the width the step's scorers ran at."""
    k, width = top_count(vocab, top_width), MAX_TOKEN_IDS_LOGPROB
    parts: dict[int, list[_Scores]] = {}  # row -> its pieces, in position order
    tokens = None
    for row, seq in enumerate(step.seqs):
        if scores_position_zero(seq):
            tokens = from_wire(step.tokens) if tokens is None else tokens
            parts[row] = [_Scores(0, tokens[seq.start : seq.start + 1], np.full(1, np.nan, np.float32), np.full((1, k), -1, np.int32),
                                  np.full((1, k), np.nan, np.float32), np.full((1, width), np.nan, np.float32), np.zeros(1, np.int32))]
    for sub, (logprobs, top_ids, top_lps, ids_lps, ranks) in scored:
        lp, rk = np.asarray(logprobs), np.asarray(ranks)
        wants_top, wants_ids = bool(sub.score.top.any()), bool((sub.score.ids < vocab).any())
        ids, tlp = (np.asarray(top_ids), np.asarray(top_lps)) if wants_top else (None, None)
        of_ids = np.asarray(ids_lps) if wants_ids else None
        offset = 0
        for s in sub.scored:
            span = slice(offset, offset + s.count)
            parts.setdefault(s.row, []).append(_Scores(s.first, sub.score.target[span], lp[span], None if ids is None else ids[span],
                                                       None if tlp is None else tlp[span], None if of_ids is None else of_ids[span], rk[span]))
            offset += s.count
    out = []
    for row in sorted(parts):
        seq, pieces = step.seqs[row], parts[row]
        assert all(a.first + len(a.targets) == b.first for a, b in zip(pieces, pieces[1:])), f"{seq.rid}: scored positions not contiguous"
        n, n_ids = min(params[row].prompt_alternatives(), k), len(params[row].token_ids_logprob)
        top_ids = top_lps = ids_lps = None
        if n:
            top_ids = to_wire(np.concatenate([p.top_ids[:, :n] for p in pieces]).astype(np.int32))
            top_lps = to_wire(np.concatenate([p.top_lps[:, :n] for p in pieces]).astype(np.float32))
        if n_ids:
            ids_lps = to_wire(np.concatenate([p.ids_lps[:, :n_ids] for p in pieces]).astype(np.float32))
        out.append(PromptScores(seq.rid, pieces[0].first, tuple(np.concatenate([p.targets for p in pieces]).tolist()),
                                tuple(np.concatenate([p.lps for p in pieces]).astype(np.float64).tolist()), top_ids, top_lps,
                                ids_lps, to_wire(np.concatenate([p.ranks for p in pieces]).astype(np.int32))))
    return tuple(out)
