"""From a scheduler Step to the padded device inputs of compiled step shapes.

A compiled step has a fixed shape: T tokens, how it reads their cached context, and R sampled rows
with R = min(T, max rows). Steps of up to `page_list_tokens` tokens (decode, short chunks; every
step where the attention kernel reads the cache, by default) give each token the list of its row's
cached pages, O = max_pages columns (layers/attention.py's page lists: one shape per token bucket,
whatever the contexts); larger ones (prefill chunks) list W (token, page) pairs, bucketed.
`Buckets` lists the shapes (T, W, O), W or O 0; a Step is padded up to the smallest one that holds
it. A Step larger than the largest bucket (a long prompt chunk over a long context) is cut into
sub-steps that run in order, each writing its keys and values before the next reads them, so no
Step is ever refused for its size and nothing compiles while serving.

The packer owns the geometry: buckets, the cut into sub-steps, where each token and pair goes. Each
group of device inputs (inputs.py) owns its fields: the packer fills a padded group per sub-step.
Besides the forward's inputs, a sub-step carries those of the optional executables: penalties and
logit bias of its sampled rows (`PenaltyInputs`, dense over the vocabulary), and the prompt
positions it scores (`ScoreInputs`): those of positions.py whose predictor this sub-step holds, so a
Step cut into sub-steps scores exactly what it scores whole.

Shapes in the legend of worker_svc/__init__.py.
"""

from __future__ import annotations

import bisect
import sys
from dataclasses import dataclass, replace

import numpy as np

from jaxstream.arrays import from_wire
from jaxstream.protocol import SamplingParams, Step, StepSeq
from worker_svc.history import TokenHistory
from worker_svc.layers.attention import pages_up_to
from worker_svc.inputs import PenaltyInputs, SamplingInputs, ScoreInputs, StepInputs, penalty_rows, sample_slots, sampling_rows, score_rows
from worker_svc.positions import predicted_by, token_at


# Fewest tokens a compiled step takes. A one-token step (one request decoding) runs its matmuls on
# one row: XLA:CPU's matrix-vector product reads the LM head at ~1.7x the rate of a two-row product
# (docs/journal.md). Its cache write alone is padded to two (executables._two_writes).
MIN_TOKENS = 1
# Steps of up to this many tokens read page lists where no kernel of ours reads the cache
# (Numerics.kernel_attends): XLA's page-list loop gathers every token's pages, which outgrows pairs
# for long chunks.
PAGE_LIST_TOKENS = 64


@dataclass(frozen=True)
class Buckets:
    tokens: tuple[int, ...]  # ascending, from MIN_TOKENS
    pairs: tuple[int, ...]  # ascending
    max_rows: int  # the scheduler's max running requests
    max_pages: int  # pages one request may hold (its longest context)
    # Token buckets up to this read their cached context through page lists, larger ones through
    # pairs (config worker.page_list_tokens; 0: pairs only, as batch_invariant's attention needs).
    # None: the engine's choice (`choose_page_lists`), made before any other use.
    page_list_tokens: int | None = PAGE_LIST_TOKENS

    def __post_init__(self) -> None:
        if self.tokens[0] < MIN_TOKENS:
            raise ValueError(f"token buckets start at {MIN_TOKENS}, got {self.tokens}")

    def choose_page_lists(self, kernel: bool) -> Buckets:
        """These buckets with page_list_tokens chosen where the config leaves it None: every bucket
        where the attention kernel reads the cache (`kernel`), which reads a token's pages in place
        at any length, where pairs cost a pass over the step's whole softmax state per PAIR_CHUNK
        pairs (docs/journal.md); else PAGE_LIST_TOKENS."""
        if self.page_list_tokens is not None:
            return self
        return replace(self, page_list_tokens=self.tokens[-1] if kernel else PAGE_LIST_TOKENS)

    def rows(self, tokens: int) -> int:
        return min(tokens, self.max_rows)

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every (tokens, pairs, page list columns) shape a step can need, to compile at start-up:
        a page-list bucket without cached context and with it; for a pairs bucket, t tokens read at
        most t * max_pages pairs, so a larger pairs bucket than the first to hold that is skipped."""
        shapes = []
        for t in self.tokens:
            if t <= self.page_list_tokens:
                shapes += [(t, 0, 0), (t, 0, self.max_pages)]
                continue
            for i, w in enumerate(self.pairs):
                if i == 0 or self.pairs[i - 1] < t * self.max_pages:
                    shapes.append((t, w, 0))
        return shapes

    def page_lists(self, tokens: int) -> bool:
        """Whether a step of `tokens` tokens fits a bucket that reads its cache through page lists."""
        i = bisect.bisect_left(self.tokens, tokens)
        return i < len(self.tokens) and self.tokens[i] <= self.page_list_tokens

    def fit(self, tokens: int, pairs: int) -> tuple[int, int, int]:
        """The smallest shape for `tokens` tokens reading `pairs` (token, page) pairs of cache."""
        t = self.tokens[bisect.bisect_left(self.tokens, tokens)]
        if t <= self.page_list_tokens:
            return t, 0, self.max_pages if pairs else 0
        return t, self.pairs[bisect.bisect_left(self.pairs, pairs)], 0


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
    rids: list[str]  # of the sampled rows, in row order (a seq with drafts has drafts + 1 rows, in position order)
    shape: tuple[int, int, int]  # the bucket (tokens, pairs, page list columns)
    sampled: list[int]  # index in Step.seqs of each sampled row
    sample_slot: np.ndarray  # [R]: inputs.sample_slots
    positions: list[int]  # the position of the token each sampled row samples
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
    samples: int  # its last `samples` tokens' logits are sampled (a seq's last token's; a draft's, each)
    pairs: int  # the (token, page) pairs its tokens read


class StepPacker:
    def __init__(self, buckets: Buckets, page_size: int, num_pages: int, salt: int, vocab: int = 0, every_page: bool = False,
                 snapshots: int = 0) -> None:
        """`every_page` (worker.batch_invariant, layers/ordered_attention.py): a token's
        pairs are every page of its row up to its own position, this step's included; else the
        pages holding the row's cached context only. `snapshots`: the state snapshot rows after the
        request slots (a hybrid's prefix cache: layers/paged.py)."""
        self.buckets = buckets
        self.snapshots = snapshots
        self.every_page = every_page
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
            sub.penalties = penalty_rows([params[i] for i in sub.sampled], sub.rids, self.buckets.rows(sub.shape[0]), self.vocab, history,
                                         sub.positions)
            self._scores(chunks, step, params, tokens, sub)
            subs.append(sub)
        return subs

    def _split(self, step: Step) -> list[list[_Chunk]]:
        """Cut the Step's rows into sub-steps that fit the largest bucket, in token order. A Step
        whose tokens fit a page-list bucket is not cut for its pairs: page lists have none."""
        max_t, max_w = self.buckets.tokens[-1], self.buckets.pairs[-1]
        if self.buckets.page_lists(sum(seq.num_tokens for seq in step.seqs)):
            max_w = sys.maxsize
        groups: list[list[_Chunk]] = [[]]
        used_t = used_w = 0
        for row, seq in enumerate(step.seqs):
            done, cached = 0, seq.context_len - seq.num_tokens
            first_sampled = seq.num_tokens - 1 - seq.drafts if seq.sample else seq.num_tokens  # a draft's tokens each sample
            while done < seq.num_tokens:
                fits, pairs = self._fit(cached, min(seq.num_tokens - done, max_t - used_t), max_w - used_w)
                if fits == 0:
                    if used_t == 0:  # not even one token, alone in a sub-step
                        raise ValueError(f"request {seq.rid}: {cached} cached tokens exceed the largest pairs bucket {max_w}")
                    groups.append([])
                    used_t = used_w = 0
                    continue
                samples = max(done + fits - max(done, first_sampled), 0)
                groups[-1].append(_Chunk(row, seq.start + done, fits, cached, samples, pairs))
                used_t, used_w = used_t + fits, used_w + pairs
                done, cached = done + fits, cached + fits
        return groups

    def _fit(self, cached: int, count: int, room: int) -> tuple[int, int]:
        """How many of a row's next `count` tokens, after `cached` in the cache, fit in `room`
        pairs, and the pairs they read."""
        if self.every_page:  # the token at position p reads pages 0 .. p // Z
            pairs = np.cumsum(pages_up_to(cached + np.arange(count), self.page_size)[0])  # [count]: of the first n tokens
            fits = int(np.searchsorted(pairs, room, side="right"))
            return fits, int(pairs[fits - 1]) if fits else 0
        pages = -(-cached // self.page_size)  # each token reads each cached page: arithmetic, on the hot path
        fits = min(count, room // pages) if pages else count
        return fits, fits * pages

    def _pad(self, chunks: list[_Chunk], step: Step, params: list[SamplingParams], tokens, positions, table) -> SubStep:
        """Place the chunks' tokens and their pages (lists or pairs) in the smallest bucket that holds them."""
        shape = self.buckets.fit(sum(c.count for c in chunks), sum(c.pairs for c in chunks))
        rows, ps, page_lists = self.buckets.rows(shape[0]), self.page_size, shape[2] > 0
        inputs = StepInputs.padded(*shape, rows, self.num_slots)
        ctx, sampled, sampled_at = inputs.ctx, [], []
        t = w = 0
        for chunk in chunks:
            seq = step.seqs[chunk.row]
            span, fed = slice(t, t + chunk.count), slice(chunk.first, chunk.first + chunk.count)
            p = positions[fed]
            inputs.tokens[span], ctx.positions[span], ctx.segment[span] = tokens[fed], p, chunk.row
            inputs.write_slot[span] = table[chunk.row, p // ps] * ps + p % ps
            if seq.follows:
                inputs.follow[span] = self._slot(seq)
            if seq.slot >= 0:  # the row's recurrent state, for a model with linear layers (layers/paged.py)
                ctx.state_slot[span] = self._slot(seq)
                # A snapshot row (past the slots) to start from, read by the seq's first chunk only (a
                # later sub-step's chunk resumes from the slot), and one to save into, by its last.
                if seq.state_from >= 0 and chunk.first == seq.start:
                    ctx.state_from[span] = self._snapshot(seq, seq.state_from)
                if seq.state_to >= 0 and chunk.first + chunk.count == seq.start + seq.num_tokens:
                    ctx.state_save[span] = self._snapshot(seq, seq.state_to)
            if chunk.pairs and page_lists:  # each token lists its row's cached pages
                pages = -(-chunk.cached // ps)
                if pages > shape[2]:
                    raise ValueError(f"request {seq.rid}: {chunk.cached} cached tokens fill {pages} pages, more than a "
                                     f"request may hold ({shape[2]}: the worker's max_pages)")
                ctx.pages[span, :pages] = table[chunk.row, :pages]
                ctx.cached[span] = chunk.cached
            elif chunk.pairs:  # each token reads its pages, in order, token after token
                if self.every_page:  # up to its own position's
                    pages, index = pages_up_to(p, ps)
                else:  # the row's cached ones
                    pages = chunk.pairs // chunk.count
                    index = np.tile(np.arange(pages, dtype=np.int32), chunk.count)
                pairs = slice(w, w + chunk.pairs)
                ctx.pair_token[pairs] = np.repeat(np.arange(t, t + chunk.count, dtype=np.int32), pages)
                ctx.pair_page[pairs] = table[chunk.row, index]
                ctx.pair_start[pairs] = index * ps
                ctx.pair_limit[pairs] = chunk.cached
                w = pairs.stop
            t += chunk.count
            for j in range(chunk.count - chunk.samples, chunk.count):  # each samples the token after its own
                inputs.sample_at[len(sampled)] = t - chunk.count + j
                sampled.append(chunk.row)
                sampled_at.append(int(p[j]) + 1)
        seqs = [step.seqs[i] for i in sampled]
        slots = sample_slots(rows, self.buckets.max_rows)
        for r, seq in enumerate(seqs):
            if seq.slot >= 0 and not seq.drafts:  # a draft's request never follows: its slot keeps nothing
                slots[r] = self._slot(seq)
        sampling = sampling_rows([params[i] for i in sampled], seqs, rows, self.salt, sampled_at)
        return SubStep(inputs, sampling, [seq.rid for seq in seqs], shape, sampled, slots, sampled_at)

    def _slot(self, seq: StepSeq) -> int:
        if not 0 <= seq.slot < self.buckets.max_rows:
            raise ValueError(f"request {seq.rid}: slot {seq.slot} is outside [0, {self.buckets.max_rows}) "
                             "(the scheduler's max running requests must equal the worker's)")
        return seq.slot

    def _snapshot(self, seq: StepSeq, row: int) -> int:
        """A snapshot's row in the state arrays: after the request slots."""
        if not row < self.snapshots:
            raise ValueError(f"request {seq.rid}: state snapshot {row} is outside [0, {self.snapshots}) "
                             "(the scheduler's state_snapshots must equal the worker's)")
        return self.buckets.max_rows + row

    def _scores(self, chunks: list[_Chunk], step: Step, params: list[SamplingParams], tokens: np.ndarray, sub: SubStep) -> None:
        """Fill sub.score and sub.scored with the prompt positions whose predictor is in this
        sub-step (StepSeq.score_from). Position 0 (logprob NaN, no predictor) is the engine's."""
        at, target, seq_of, entries = [], [], [], []
        t = 0  # the chunk's first token in the sub-step
        for chunk in chunks:
            seq = step.seqs[chunk.row]
            c0 = chunk.cached  # the chunk feeds positions [c0, c0 + count)
            window = predicted_by(seq, c0, chunk.count)
            q = np.arange(window.start, window.stop)
            if len(q):
                at.append(t + q - 1 - c0)
                target.append(token_at(seq, tokens[seq.start : seq.start + seq.num_tokens], q))
                seq_of += [chunk.row] * len(q)
                entries.append(Scored(chunk.row, int(q[0]), len(q)))
            t += chunk.count
        if entries:
            t_bucket = sub.shape[0]
            sub.score = score_rows(np.concatenate(at), np.concatenate(target), seq_of, params, t_bucket, self.buckets.rows(t_bucket), self.vocab)
            sub.scored = entries
