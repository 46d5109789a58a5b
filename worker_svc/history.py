"""The tokens of each request that uses a penalty, as the worker saw them fed: what the repetition,
frequency and presence penalties count.

Every token a Step feeds for a request sits at a known position: prompt chunks, and each decode's
input token, which is the request's previous output. Positions below StepSeq.prompt_len are prompt,
the rest output. A feed starting at position p supersedes whatever was held from p on, so a
recompute after preemption (from position 0, or from a cached prefix) rebuilds the same history.
The positions a prefix cache hit skips are never fed: the Step brings them along
(StepSeq.history), and they are fed as from position 0 first. A feed starting past the end of
what is held (the request's history was evicted) leaves the gap uncounted.

The worker is never told that a request ended, so histories are kept least recently fed first
and the oldest dropped beyond `capacity` requests: generous (several times the most requests a
step can hold), so only finished requests are ever dropped. Requests without a penalty keep none.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

MIN_CAPACITY = 1024  # requests remembered at least; a history costs 4 bytes a token plus its counts


class _Seq:
    def __init__(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.tokens = np.empty(64, np.int32)  # by position; -1: unknown (a gap)
        self.length = 0
        self.prompt: dict[int, int] = {}  # token -> occurrences at positions < prompt_len
        self.output: dict[int, int] = {}  # token -> occurrences at positions >= prompt_len

    def feed(self, start: int, tokens: np.ndarray) -> None:
        if start < self.length:
            self._tally(start, self.tokens[start : self.length], -1)
        elif start > self.length:
            self._reserve(start)
            self.tokens[self.length : start] = -1
        end = start + len(tokens)
        self._reserve(end)
        self.tokens[start:end] = tokens
        self.length = end
        self._tally(start, tokens, 1)

    def _reserve(self, n: int) -> None:
        if n > len(self.tokens):
            grown = np.empty(max(n, 2 * len(self.tokens)), np.int32)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown

    def _tally(self, start: int, tokens: np.ndarray, sign: int) -> None:
        split = min(max(self.prompt_len - start, 0), len(tokens))
        for counts, part in ((self.prompt, tokens[:split]), (self.output, tokens[split:])):
            ids, n = np.unique(part[part >= 0], return_counts=True)
            for token, k in zip(ids.tolist(), n.tolist()):
                left = counts.get(token, 0) + sign * k
                if left:
                    counts[token] = left
                else:
                    del counts[token]


class TokenHistory:
    def __init__(self, capacity: int = MIN_CAPACITY) -> None:
        self.capacity = capacity
        self._seqs: OrderedDict[str, _Seq] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, rid: str) -> bool:
        return rid in self._seqs

    def feed(self, rid: str, start: int, tokens: np.ndarray, prompt_len: int) -> None:
        """The Step fed `tokens` at positions start, start + 1, ... to request `rid`."""
        seq = self._seqs.pop(rid, None)
        if seq is None or start == 0:
            seq = _Seq(prompt_len)
        seq.feed(start, tokens)
        self._seqs[rid] = seq  # now the most recent
        while len(self._seqs) > self.capacity:
            self._seqs.popitem(last=False)

    def fill(self, rid: str, seen: np.ndarray, count: np.ndarray, before: int | None = None) -> None:
        """Write the request's rows: seen [V] (in prompt or output) and count [V] (in the output), of
        its tokens at positions below `before` (None: all; a draft's row counts the draft's tokens
        before its own only)."""
        seq = self._seqs.get(rid)
        if seq is None:
            return
        prompt, output = seq.prompt, seq.output
        if before is not None and before < seq.length:  # leave out the tokens from `before` on
            prompt, output = dict(prompt), dict(output)
            for position, token in enumerate(seq.tokens[before : seq.length].tolist(), before):
                counts = prompt if position < seq.prompt_len else output
                if token >= 0:
                    counts[token] -= 1
                    if not counts[token]:
                        del counts[token]
        for counts in (prompt, output):
            if counts:
                seen[np.fromiter(counts, np.int64, len(counts))] = True
        if output:
            count[np.fromiter(output, np.int64, len(output))] = np.fromiter(output.values(), np.int32, len(output))

    def tokens(self, rid: str) -> np.ndarray:
        """The request's tokens by position (-1 where unknown); empty when not held."""
        seq = self._seqs.get(rid)
        return np.empty(0, np.int32) if seq is None else seq.tokens[: seq.length].copy()
