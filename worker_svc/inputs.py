"""The groups of per-step device inputs the packer (batch.py) builds and the engine lowers.

Each group declares its fields once, in one `padded` constructor (layers/abstract.py): the packer
fills the rows of a padded group, and the engine lowers with the group's `shapes`. A new per-step
input joins a group there, or comes as a group of its own with the same two methods.

  StepInputs       the forward's: tokens, write slots, sampled tokens, followers; PagedContext
                   (layers/attention.py) for positions and pairs, placed by StepPacker
  SamplingInputs   (layers/sampling.py) the sampled rows' parameters: `sampling_rows`
  PenaltyInputs    (layers/penalties.py) their penalties and logit bias, dense: `penalty_rows`
  ScoreInputs      the prompt positions a sub-step scores: `score_rows`

Shapes in the legend of worker_svc/__init__.py.
"""

from __future__ import annotations

import zlib
from typing import Callable, NamedTuple

import numpy as np

from jaxstream.protocol import MAX_TOKEN_IDS_LOGPROB, SamplingParams, StepSeq
from worker_svc.history import TokenHistory
from worker_svc.layers import abstract
from worker_svc.layers.attention import PagedContext
from worker_svc.layers.penalties import PenaltyInputs
from worker_svc.layers.sampling import NO_TOKEN, SamplingInputs


class StepInputs(NamedTuple):
    """Everything one compiled step reads, besides the parameters and the cache."""

    tokens: np.ndarray  # [T] i32
    ctx: PagedContext
    write_slot: np.ndarray  # [T] i32: flat cache slot (page * page_size + offset); out of range for padding
    sample_at: np.ndarray  # [R] i32: the token whose logits each sampled row uses
    # [T] i32: for the token of a seq that follows (StepSeq.follows), its request's slot: the token is
    # the one that slot sampled last, read on the device; -1: the token is `tokens`'
    follow: np.ndarray

    @classmethod
    def padded(cls, tokens: int, pairs: int, page_list: int, rows: int, no_slot: int, full: Callable = np.full) -> StepInputs:
        """Every token padding, written to `no_slot` (the cache's size: dropped)."""
        return cls(tokens=full(tokens, 0, np.int32), ctx=PagedContext.padded(tokens, pairs, page_list, full),
                   write_slot=full(tokens, no_slot, np.int32), sample_at=full(rows, 0, np.int32), follow=full(tokens, -1, np.int32))

    @classmethod
    def shapes(cls, tokens: int, pairs: int, page_list: int, rows: int) -> StepInputs:
        return cls.padded(tokens, pairs, page_list, rows, 0, abstract.full)


def sample_slots(rows: int, no_slot: int, full: Callable = np.full) -> np.ndarray:
    """[R] i32: the slot of engine.last each sampled row's token is kept in; padding `no_slot`
    (the number of slots: dropped)."""
    return full(rows, no_slot, np.int32)


class ScoreInputs(NamedTuple):
    """The prompt positions one sub-step scores, one entry each, padded to its T tokens."""

    at: np.ndarray  # [T] i32: the sub-step token whose hidden state predicts the entry
    target: np.ndarray  # [T] i32: the prompt token scored
    temperature: np.ndarray  # [T] f32: the request's; < MIN_TEMPERATURE counts as 1
    raw: np.ndarray  # [T] bool: raw logits (no bias, T = 1)
    top: np.ndarray  # [T] bool: alternatives wanted
    bias_row: np.ndarray  # [T] i32: the row of `bias` added to the logits; R: none
    bias: np.ndarray | None  # [R, V] f32; None: zeros (the engine passes a device copy it keeps)
    ids: np.ndarray  # [T, I] i32: the request's token_ids_logprob, NO_TOKEN pads (layers/sampling.py)

    @classmethod
    def padded(cls, tokens: int, rows: int, vocab: int, full: Callable = np.full, bias: bool = True) -> ScoreInputs:
        """Every entry padding (no bias row, no id asked); without `bias`, bias None."""
        return cls(at=full(tokens, 0, np.int32), target=full(tokens, 0, np.int32), temperature=full(tokens, 1.0, np.float32),
                   raw=full(tokens, False, np.bool_), top=full(tokens, False, np.bool_), bias_row=full(tokens, rows, np.int32),
                   bias=full((rows, vocab), 0.0, np.float32) if bias else None,
                   ids=full((tokens, MAX_TOKEN_IDS_LOGPROB), NO_TOKEN, np.int32))

    @classmethod
    def shapes(cls, tokens: int, rows: int, vocab: int) -> ScoreInputs:
        return cls.padded(tokens, rows, vocab, abstract.full)


# SamplingParams fields a sampled row takes as they are, under the same names in SamplingInputs.
_AS_GIVEN = ("temperature", "top_k", "top_p", "min_p", "raw_logprobs", "top_logprobs", "processed_logprobs")


def sampling_rows(params: list[SamplingParams], seqs: list[StepSeq], rows: int, salt: int, positions: list[int]) -> SamplingInputs:
    """The sampled rows' SamplingInputs, in order, padded to `rows`; `positions`: each row's sampled
    token's (its seq's context_len, or for a draft's rows each a position of its own)."""
    s = SamplingInputs.padded(rows)
    n = len(params)
    for name in _AS_GIVEN:
        getattr(s, name)[:n] = [getattr(p, name) for p in params]
    s.seed[:n] = [seed_of(p, seq.rid, salt) for p, seq in zip(params, seqs)]
    s.position[:n] = positions
    for r, seq in enumerate(seqs):
        s.banned[r, : len(seq.banned)] = seq.banned
    for r, p in enumerate(params):
        s.ids[r, : len(p.token_ids_logprob)] = p.token_ids_logprob
    return s


def penalty_rows(params: list[SamplingParams], rids: list[str], rows: int, vocab: int,
                 history: TokenHistory | None, positions: list[int]) -> PenaltyInputs | None:
    """Dense rows for the sampled rows that use a penalty, a logit bias or allowed_token_ids; None
    when none does. `history` holds what the penalties count; `positions`, each row's sampled
    token's: the row counts the tokens before it (a draft's row, only the draft tokens before its own)."""
    penalized = [s.uses_penalty() for s in params]
    biased = [bool(s.logit_bias) for s in params]
    restricted = [bool(s.allowed_token_ids) for s in params]
    if not any(penalized) and not any(biased) and not any(restricted):
        return None
    p = PenaltyInputs.padded(rows, vocab, bias=any(biased), counts=any(penalized), blocked=any(restricted))
    for r, (rid, s) in enumerate(zip(rids, params)):
        if biased[r]:
            fill_bias(p.bias[r], s)
        if restricted[r]:
            p.blocked[r] = True
            p.blocked[r, list(s.allowed_token_ids)] = False
        if penalized[r]:
            p.repetition[r], p.frequency[r], p.presence[r] = s.repetition_penalty, s.frequency_penalty, s.presence_penalty
            if history is not None:
                history.fill(rid, p.seen[r], p.count[r], positions[r])
    return p


def score_rows(at: np.ndarray, target: np.ndarray, seq_of: list[int], params: list[SamplingParams], tokens: int, rows: int,
               vocab: int) -> ScoreInputs:
    """ScoreInputs of the entries `at` and `target`; `seq_of`: each entry's index in Step.seqs, whose
    `params` it is scored under."""
    n = len(seq_of)
    entry = [params[i] for i in seq_of]
    biased = sorted({i for i in seq_of if params[i].logit_bias})  # the rows of `bias`
    s = ScoreInputs.padded(tokens, rows, vocab, bias=bool(biased))
    s.at[:n], s.target[:n] = at, target
    s.temperature[:n] = [p.temperature for p in entry]
    s.raw[:n] = [p.raw_logprobs for p in entry]
    s.top[:n] = [p.prompt_alternatives() > 0 for p in entry]
    s.bias_row[:n] = [biased.index(i) if i in biased else rows for i in seq_of]
    for r, i in enumerate(biased):
        fill_bias(s.bias[r], params[i])
    for e, p in enumerate(entry):
        s.ids[e, : len(p.token_ids_logprob)] = p.token_ids_logprob
    return s


def seed_of(params: SamplingParams, rid: str, salt: int) -> int:
    """The request's seed, or for an unseeded request one fixed per request for this worker's life,
    so its draws still differ position by position and never repeat another request's."""
    if params.seed is not None:
        return params.seed & 0xFFFFFFFF
    return (zlib.crc32(rid.encode()) ^ salt) & 0xFFFFFFFF


def fill_bias(row: np.ndarray, params: SamplingParams) -> None:
    """Write the request's logit bias into its dense row [V] of zeros."""
    if params.logit_bias:
        ids, values = zip(*params.logit_bias)
        row[list(ids)] = values
