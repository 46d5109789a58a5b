"""N-gram drafts (prompt lookup, vLLM's "ngram" speculative method): guess a request's next tokens
from its own.

If the last n tokens of a request (prompt and output so far) occurred earlier in it, the tokens that
followed that earlier occurrence are a likely continuation: a model copying a passage, editing code
or quoting its prompt repeats long runs. The longest n from `max_n` down to `min_n` that matches
wins, and among its occurrences the latest. The draft is then verified by the worker in one step
(protocol.StepSeq.drafts), so a wrong guess costs compute, never a wrong token.

Pure and incremental: each request keeps an index of where every n-gram of its tokens last ended,
fed only the tokens it has not seen, so a lookup costs O(max_n - min_n) dict reads however long the
request is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NgramDrafter:
    """The configuration (scheduler.speculative=ngram): up to `tokens` draft tokens per step, from
    suffixes of `min_n` to `max_n` tokens."""

    tokens: int
    min_n: int
    max_n: int

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n or self.tokens < 1:
            raise ValueError(f"need 1 <= min_n <= max_n and tokens >= 1, got {self}")

    @classmethod
    def configured(cls, scheduler) -> NgramDrafter | None:
        """From the scheduler's config (jaxstream.config.SchedulerConfig); None: speculative=none."""
        if scheduler.speculative != "ngram":
            return None
        return cls(scheduler.num_speculative_tokens, scheduler.prompt_lookup_min, scheduler.prompt_lookup_max)

    def index(self) -> NgramIndex:
        return NgramIndex(self.min_n, self.max_n)


class NgramIndex:
    """One request's n-grams. `tokens` are the ones fed so far, a prefix of the request's tokens
    (which only grow: a request's prompt and output are never rewritten)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # n-gram -> the end (exclusive) of its latest occurrence, among those ending before the last
        # token's end: the suffix itself is never its own match.
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # occurrences ending at or before this are in _ends

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens += tokens

    def draft(self, limit: int) -> list[int]:
        """`limit` tokens following the latest earlier occurrence of the longest matching suffix as
        they followed it there; [] when no suffix of min_n tokens or more occurred before."""
        tokens, n_tokens = self.tokens, len(self.tokens)
        for end in range(self._indexed + 1, n_tokens):  # occurrences ending before the last token's end
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, n_tokens - 1)
        for n in range(min(self.max_n, n_tokens), self.min_n - 1, -1):
            end = self._ends.get(tuple(tokens[n_tokens - n :]))
            if end is not None:
                # An occurrence close to the end continues into the suffix itself: the run between
                # them repeats (period n_tokens - end), as a model that loops goes on looping.
                period = n_tokens - end
                return [tokens[end + i % period] for i in range(limit)]
        return []
