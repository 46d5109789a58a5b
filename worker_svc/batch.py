"""From a scheduler Step to the padded device inputs of compiled step shapes.

A compiled step has a fixed shape: T tokens, W (token, page) pairs of cached context, and R sampled
rows with R = min(T, max rows). `Buckets` lists the shapes; a Step is padded up to the smallest one
that holds it. A Step larger than the largest bucket (a long prompt chunk over a long context) is
cut into sub-steps that run in order, each writing its keys and values before the next reads them,
so no Step is ever refused for its size and nothing compiles while serving.

Legend: T tokens, W pairs, R sampled rows, P pages.
"""

from __future__ import annotations

import bisect
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from jaxstream.arrays import from_wire
from jaxstream.protocol import MAX_BANNED_TOKENS, SamplingParams, Step
from worker_svc.layers.attention import PagedContext
from worker_svc.layers.sampling import NO_TOKEN, SamplingInputs


class StepInputs(NamedTuple):
    """Everything one compiled step reads, besides the parameters and the cache."""

    tokens: np.ndarray  # [T] i32
    ctx: PagedContext
    write_slot: np.ndarray  # [T] i32: flat cache slot (page * page_size + offset); out of range for padding
    sample_at: np.ndarray  # [R] i32: the token whose logits each sampled row uses


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
class SubStep:
    inputs: StepInputs
    sampling: SamplingInputs  # [R] each
    rids: list[str]  # of the sampled rows, in row order
    shape: tuple[int, int]  # the bucket (tokens, pairs)


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


class StepPacker:
    def __init__(self, buckets: Buckets, page_size: int, num_pages: int, salt: int) -> None:
        self.buckets = buckets
        self.page_size = page_size
        self.num_slots = num_pages * page_size  # a write to this slot is dropped
        self.salt = salt

    def pack(self, step: Step) -> list[SubStep]:
        tokens, positions = from_wire(step.tokens), from_wire(step.positions)
        table = from_wire(step.page_table)
        return [self._pad(chunks, step, tokens, positions, table) for chunks in self._split(step)]

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

    def _pad(self, chunks: list[_Chunk], step: Step, tokens, positions, table) -> SubStep:
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
        rids: list[str] = []

        t = w = 0
        for chunk, pages in zip(chunks, pages_of):
            seq = step.seqs[chunk.row]
            span = slice(t, t + chunk.count)
            p = positions[chunk.first : chunk.first + chunk.count]
            tok[span] = tokens[chunk.first : chunk.first + chunk.count]
            pos[span] = p
            seg[span] = chunk.row
            slot[span] = table[chunk.row, p // ps] * ps + p % ps
            if pages:
                n = chunk.count * pages
                pair_token[w : w + n] = np.repeat(np.arange(t, t + chunk.count, dtype=np.int32), pages)
                pair_page[w : w + n] = np.tile(table[chunk.row, :pages], chunk.count)
                pair_start[w : w + n] = np.tile(np.arange(pages, dtype=np.int32) * ps, chunk.count)
                pair_limit[w : w + n] = chunk.cached
                w += n
            t += chunk.count
            if chunk.sample:
                r, s = len(rids), seq.sampling
                sample_at[r] = t - 1
                temperature[r] = s.temperature
                top_k[r] = s.top_k
                top_p[r] = s.top_p
                min_p[r] = s.min_p
                seed[r] = seed_of(s, seq.rid, self.salt)
                sample_pos[r] = seq.context_len
                banned[r, : len(seq.banned)] = seq.banned
                rids.append(seq.rid)

        ctx = PagedContext(pos, seg, pair_token, pair_page, pair_start, pair_limit)
        sampling = SamplingInputs(temperature, top_k, top_p, min_p, seed, sample_pos, banned)
        return SubStep(StepInputs(tok, ctx, slot, sample_at), sampling, rids, (t_bucket, w_bucket))
