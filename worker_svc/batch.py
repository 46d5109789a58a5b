"""From a scheduler Step to the padded device inputs of compiled step shapes.

A compiled step has a fixed shape: T tokens, W (token, page) pairs of cached context, and R sampled
rows with R = min(T, max rows). `Buckets` lists the shapes; a Step is padded up to the smallest one
that holds it. A Step larger than the largest bucket (a long prompt chunk over a long context) is
cut into sub-steps that run in order, each writing its keys and values before the next reads them,
so no Step is ever refused for its size and nothing compiles while serving.

Besides the forward's inputs, a sub-step carries those of the optional executables: penalties and
logit bias of its sampled rows (`PenaltyInputs`, dense over the vocabulary), and the prompt
positions it scores (`ScoreInputs`, StepSeq.score_from): position q is predicted by the hidden
state of the token at q - 1, which this sub-step holds; its target is the Step's token at q, or
StepSeq.next_token for the one after the Step's last. So a Step cut into sub-steps scores exactly
what it scores whole.

Legend: T tokens, W pairs, R sampled rows, P pages, V vocab.
"""

from __future__ import annotations

import bisect
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from jaxstream.arrays import from_wire
from jaxstream.protocol import MAX_BANNED_TOKENS, SamplingParams, Step, StepSeq
from worker_svc.history import TokenHistory
from worker_svc.layers.attention import PagedContext
from worker_svc.layers.penalties import PenaltyInputs
from worker_svc.layers.sampling import NO_TOKEN, SamplingInputs
from worker_svc.positions import first_position, scored


class StepInputs(NamedTuple):
    """Everything one compiled step reads, besides the parameters and the cache."""

    tokens: np.ndarray  # [T] i32
    ctx: PagedContext
    write_slot: np.ndarray  # [T] i32: flat cache slot (page * page_size + offset); out of range for padding
    sample_at: np.ndarray  # [R] i32: the token whose logits each sampled row uses
    # [T] i32: for the token of a seq that follows (StepSeq.follows), its request's slot: the token is
    # the one that slot sampled last, read on the device; -1: the token is `tokens`'
    follow: np.ndarray


class ScoreInputs(NamedTuple):
    """The prompt positions one sub-step scores, one entry each, padded to its T tokens."""

    at: np.ndarray  # [T] i32: the sub-step token whose hidden state predicts the entry
    target: np.ndarray  # [T] i32: the prompt token scored
    temperature: np.ndarray  # [T] f32: the request's; < MIN_TEMPERATURE counts as 1
    raw: np.ndarray  # [T] bool: raw logits (no bias, T = 1)
    top: np.ndarray  # [T] bool: alternatives wanted
    bias_row: np.ndarray  # [T] i32: the row of `bias` added to the logits; R: none
    bias: np.ndarray | None  # [R, V] f32; None: zeros (the engine passes a device copy it keeps)


# Fewest tokens a compiled step takes. XLA rewrites a one-token scatter (the cache write) into a
# guarded dynamic-update-slice, and for that XLA:CPU copies the whole cache; a padding token is free.
MIN_TOKENS = 2


@dataclass(frozen=True)
class Buckets:
    tokens: tuple[int, ...]  # ascending, from MIN_TOKENS
    pairs: tuple[int, ...]  # ascending
    max_rows: int  # the scheduler's max running requests
    max_pages: int  # pages one request may hold (its longest context)

    def __post_init__(self) -> None:
        if self.tokens[0] < MIN_TOKENS:
            raise ValueError(f"token buckets start at {MIN_TOKENS}, got {self.tokens}")

    def rows(self, tokens: int) -> int:
        return min(tokens, self.max_rows)

    def shapes(self) -> list[tuple[int, int]]:
        """Every (tokens, pairs) shape a step can need, to compile at start-up. t tokens read at
        most t * max_pages pairs, so a larger pairs bucket than the first to hold that is skipped."""
        shapes = []
        for t in self.tokens:
            for i, w in enumerate(self.pairs):
                if i == 0 or self.pairs[i - 1] < t * self.max_pages:
                    shapes.append((t, w))
        return shapes

    def fit(self, tokens: int, pairs: int) -> tuple[int, int]:
        return self.tokens[bisect.bisect_left(self.tokens, tokens)], self.pairs[bisect.bisect_left(self.pairs, pairs)]


@dataclass
class Scored:
    """One seq's run of entries in a sub-step's ScoreInputs (runs follow each other in entry order)."""

    row: int  # the seq's index in Step.seqs
    first: int  # position of the run's first entry; the rest follow
    count: int


@dataclass
class SubStep:
    inputs: StepInputs
    sampling: SamplingInputs  # [R] each
    rids: list[str]  # of the sampled rows, in row order
    shape: tuple[int, int]  # the bucket (tokens, pairs)
    sampled: list[int]  # index in Step.seqs of each sampled row
    sample_slot: np.ndarray  # [R] i32: the slot each sampled row's token is kept in; out of range for padding
    # Dense penalty and bias inputs, when a sampled row uses one; a None field is zeros.
    penalties: PenaltyInputs | None = None
    score: ScoreInputs | None = None  # when some seq scores a prompt position here
    scored: list[Scored] | None = None  # in entry order


@dataclass
class _Chunk:  # one row's share of a sub-step
    row: int
    first: int  # index of the chunk's first token in the Step's token array
    count: int
    cached: int  # the row's tokens already in the cache when this sub-step runs
    sample: bool


def seed_of(params: SamplingParams, rid: str, salt: int) -> int:
    """The request's seed, or for an unseeded request one fixed per request for this worker's life,
    so its draws still differ position by position and never repeat another request's."""
    if params.seed is not None:
        return params.seed & 0xFFFFFFFF
    return (zlib.crc32(rid.encode()) ^ salt) & 0xFFFFFFFF


def dense_bias(params: SamplingParams, vocab: int) -> np.ndarray:
    row = np.zeros(vocab, np.float32)
    if params.logit_bias:
        ids, values = zip(*params.logit_bias)
        row[list(ids)] = values
    return row


class StepPacker:
    def __init__(self, buckets: Buckets, page_size: int, num_pages: int, salt: int, vocab: int = 0) -> None:
        self.buckets = buckets
        self.page_size = page_size
        self.num_slots = num_pages * page_size  # a write to this slot is dropped
        self.salt = salt
        self.vocab = vocab  # for the dense penalty and bias rows

    def pack(self, step: Step, params: list[SamplingParams], history: TokenHistory | None = None) -> list[SubStep]:
        """The Step as sub-steps. `params`: each seq's sampling parameters (slots.py); `history`
        holds what the penalties count (fed this Step's tokens already)."""
        tokens, positions = from_wire(step.tokens), from_wire(step.positions)
        table = from_wire(step.page_table)
        subs = []
        for chunks in self._split(step):
            sub = self._pad(chunks, step, params, tokens, positions, table)
            sub.penalties = self._penalties(step, params, sub, history)
            self._scores(chunks, step, params, tokens, sub)
            subs.append(sub)
        return subs

    def _split(self, step: Step) -> list[list[_Chunk]]:
        """Cut the Step's rows into sub-steps that fit the largest bucket, in token order."""
        max_t, max_w = self.buckets.tokens[-1], self.buckets.pairs[-1]
        groups: list[list[_Chunk]] = [[]]
        used_t = used_w = 0
        for row, seq in enumerate(step.seqs):
            done, cached = 0, seq.context_len - seq.num_tokens
            while done < seq.num_tokens:
                pages = -(-cached // self.page_size)  # pairs per token of this chunk
                if pages > max_w:
                    raise ValueError(f"request {seq.rid}: {cached} cached tokens exceed the largest pairs bucket {max_w}")
                fits = min(seq.num_tokens - done, max_t - used_t, (max_w - used_w) // pages if pages else max_t)
                if fits == 0:
                    groups.append([])
                    used_t = used_w = 0
                    continue
                last = done + fits == seq.num_tokens
                groups[-1].append(_Chunk(row, seq.start + done, fits, cached, seq.sample and last))
                done, cached = done + fits, cached + fits
                used_t, used_w = used_t + fits, used_w + fits * pages
        return groups

    def _pad(self, chunks: list[_Chunk], step: Step, params: list[SamplingParams], tokens, positions, table) -> SubStep:
        n_tokens = sum(c.count for c in chunks)
        pages_of = [-(-c.cached // self.page_size) for c in chunks]
        n_pairs = sum(c.count * p for c, p in zip(chunks, pages_of))
        t_bucket, w_bucket = self.buckets.fit(n_tokens, n_pairs)
        r_bucket = self.buckets.rows(t_bucket)
        ps = self.page_size

        tok = np.zeros(t_bucket, np.int32)
        pos = np.zeros(t_bucket, np.int32)
        seg = np.full(t_bucket, -1, np.int32)
        slot = np.full(t_bucket, self.num_slots, np.int32)
        pair_token = np.full(w_bucket, t_bucket, np.int32)
        pair_page = np.zeros(w_bucket, np.int32)
        pair_start = np.zeros(w_bucket, np.int32)
        pair_limit = np.zeros(w_bucket, np.int32)
        sample_at = np.zeros(r_bucket, np.int32)
        temperature = np.zeros(r_bucket, np.float32)
        top_k = np.zeros(r_bucket, np.int32)
        top_p = np.ones(r_bucket, np.float32)
        min_p = np.zeros(r_bucket, np.float32)
        seed = np.zeros(r_bucket, np.uint32)
        sample_pos = np.zeros(r_bucket, np.int32)
        banned = np.full((r_bucket, MAX_BANNED_TOKENS), NO_TOKEN, np.int32)
        raw_logprobs = np.zeros(r_bucket, bool)
        processed_logprobs = np.zeros(r_bucket, bool)
        top_logprobs = np.zeros(r_bucket, np.int32)
        follow = np.full(t_bucket, -1, np.int32)
        sample_slot = np.full(r_bucket, self.buckets.max_rows, np.int32)
        rids: list[str] = []
        sampled: list[int] = []

        t = w = 0
        for chunk, pages in zip(chunks, pages_of):
            seq = step.seqs[chunk.row]
            span = slice(t, t + chunk.count)
            p = positions[chunk.first : chunk.first + chunk.count]
            tok[span] = tokens[chunk.first : chunk.first + chunk.count]
            pos[span] = p
            seg[span] = chunk.row
            slot[span] = table[chunk.row, p // ps] * ps + p % ps
            if seq.follows:
                follow[span] = self._slot(seq)
            if pages:
                n = chunk.count * pages
                pair_token[w : w + n] = np.repeat(np.arange(t, t + chunk.count, dtype=np.int32), pages)
                pair_page[w : w + n] = np.tile(table[chunk.row, :pages], chunk.count)
                pair_start[w : w + n] = np.tile(np.arange(pages, dtype=np.int32) * ps, chunk.count)
                pair_limit[w : w + n] = chunk.cached
                w += n
            t += chunk.count
            if chunk.sample:
                r, s = len(rids), params[chunk.row]
                sample_at[r] = t - 1
                temperature[r] = s.temperature
                top_k[r] = s.top_k
                top_p[r] = s.top_p
                min_p[r] = s.min_p
                seed[r] = seed_of(s, seq.rid, self.salt)
                sample_pos[r] = seq.context_len
                banned[r, : len(seq.banned)] = seq.banned
                raw_logprobs[r] = s.raw_logprobs
                processed_logprobs[r] = s.processed_logprobs
                top_logprobs[r] = s.top_logprobs
                if seq.slot >= 0:
                    sample_slot[r] = self._slot(seq)
                rids.append(seq.rid)
                sampled.append(chunk.row)

        ctx = PagedContext(pos, seg, pair_token, pair_page, pair_start, pair_limit)
        sampling = SamplingInputs(temperature, top_k, top_p, min_p, seed, sample_pos, banned, raw_logprobs, top_logprobs,
                                  processed_logprobs)
        return SubStep(StepInputs(tok, ctx, slot, sample_at, follow), sampling, rids, (t_bucket, w_bucket), sampled, sample_slot)

    def _slot(self, seq: StepSeq) -> int:
        if not 0 <= seq.slot < self.buckets.max_rows:
            raise ValueError(f"request {seq.rid}: slot {seq.slot} is outside [0, {self.buckets.max_rows}) "
                             "(the scheduler's max running requests must equal the worker's)")
        return seq.slot

    def _penalties(self, step: Step, params: list[SamplingParams], sub: SubStep,
                   history: TokenHistory | None) -> PenaltyInputs | None:
        """Dense rows for the sampled rows that use a penalty or a logit bias; None when none does."""
        rows_params = [params[i] for i in sub.sampled]
        penalized = [s.uses_penalty() for s in rows_params]
        biased = [bool(s.logit_bias) for s in rows_params]
        if not any(penalized) and not any(biased):
            return None
        rows, vocab = len(sub.sampling.seed), self.vocab
        repetition = np.ones(rows, np.float32)
        frequency = np.zeros(rows, np.float32)
        presence = np.zeros(rows, np.float32)
        bias = np.zeros((rows, vocab), np.float32) if any(biased) else None
        seen = np.zeros((rows, vocab), bool) if any(penalized) else None
        count = np.zeros((rows, vocab), np.int32) if any(penalized) else None
        for r, (i, s) in enumerate(zip(sub.sampled, rows_params)):
            if biased[r]:
                bias[r] = dense_bias(s, vocab)
            if penalized[r]:
                repetition[r], frequency[r], presence[r] = s.repetition_penalty, s.frequency_penalty, s.presence_penalty
                if history is not None:
                    history.fill(step.seqs[i].rid, seen[r], count[r])
        return PenaltyInputs(bias, seen, count, repetition, frequency, presence)

    def _scores(self, chunks: list[_Chunk], step: Step, params: list[SamplingParams], tokens: np.ndarray, sub: SubStep) -> None:
        """Fill sub.score and sub.scored with the prompt positions whose predictor is in this
        sub-step (StepSeq.score_from). Position 0 (logprob NaN, no predictor) is the engine's."""
        t_bucket = sub.shape[0]
        at, target, seq_of, entries = [], [], [], []
        t = 0  # the chunk's first token in the sub-step
        for chunk in chunks:
            seq = step.seqs[chunk.row]
            if seq.score_from >= 0:
                c0 = chunk.cached  # the chunk feeds positions [c0, c0 + count): it predicts [c0 + 1, c0 + count]
                step_range = scored(seq)
                q = np.arange(max(step_range.start, c0 + 1), min(step_range.stop, c0 + chunk.count + 1))
                if len(q):
                    inside = q < seq.context_len  # else q is the token after the Step's: next_token
                    fed = tokens[seq.start + np.where(inside, q, c0) - first_position(seq)]
                    at.append(t + q - 1 - c0)
                    target.append(np.where(inside, fed, seq.next_token))
                    seq_of += [chunk.row] * len(q)
                    entries.append(Scored(chunk.row, int(q[0]), len(q)))
            t += chunk.count
        if not entries:
            return
        n, rows = len(seq_of), self.buckets.rows(t_bucket)

        def pad(values, fill, dtype):
            return np.concatenate([np.asarray(values, dtype), np.full(t_bucket - n, fill, dtype)])

        entry_params = [params[i] for i in seq_of]
        biased = sorted({i for i in seq_of if params[i].logit_bias})  # the rows of `bias`
        bias = None
        if biased:
            bias = np.zeros((rows, self.vocab), np.float32)
            for r, i in enumerate(biased):
                bias[r] = dense_bias(params[i], self.vocab)
        sub.score = ScoreInputs(
            at=pad(np.concatenate(at), 0, np.int32),
            target=pad(np.concatenate(target), 0, np.int32),
            temperature=pad([s.temperature for s in entry_params], 1.0, np.float32),
            raw=pad([s.raw_logprobs for s in entry_params], False, bool),
            top=pad([s.top_logprobs > 0 for s in entry_params], False, bool),
            bias_row=pad([biased.index(i) if i in biased else rows for i in seq_of], rows, np.int32),
            bias=bias,
        )
        sub.scored = entries
