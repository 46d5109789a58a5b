"""Speculative decoding's part of planning (core.py's story, 8.): a decode's draft, and its verification.

A decode that feeds its last known output token may take a draft of its next tokens, from the budget
(before prompt chunks, as decodes), from free (or evictable) KV pages, never another request's, and
from the sampled rows (at most max_running per step) that no running or waiting request may need:
under load, none. The worker verifies the draft (protocol.StepSeq.drafts) and `absorb` takes its
tokens up to the first that differs from the draft's: the accepted drafts' positions are computed,
the pages past them are freed. A request with a draft in flight is not planned again until its
result is absorbed (the next step's position depends on it), and a decode about to follow whose
known tokens already promise a draft waits for its token in flight instead, so it can draft with it
next step. Not for a constrained request (its matcher would have to verify the draft too) or one
below min_new_tokens (its stop tokens are banned per row). A rejected draft token's KV and routed
experts are overwritten when its position is fed again, before any step or output reads them.

Here: `plan` asks `drafts` whether a decode would draft (one about to follow waits instead), `add`
gives the decode just planned its draft, and `absorb` hands each seq's sampled tokens to
`verified`. Drafts come from the request's own tokens (ngram.py).
"""

from __future__ import annotations

import dataclasses

from scheduler_svc.counters import Counters
from scheduler_svc.ngram import NgramDrafter
from scheduler_svc.request import PlannedSeq, Planning, Request
from scheduler_svc.request_pages import RequestPages


class Speculation:
    def __init__(self, drafter: NgramDrafter | None, pages: RequestPages, counters: Counters) -> None:
        """`drafter`: None, no drafts (every seq still has its sampled tokens verified: one each)."""
        self.drafter = drafter
        self.pages = pages
        self.counters = counters

    def drafts(self, req: Request, limit: int) -> list[int]:
        """Up to `limit` draft tokens to follow its known tokens: none without a drafter, for a
        request it may not draft for, or with no room left by max_new_tokens."""
        if self.drafter is None or req.sampling.constraint is not None or len(req.output) < req.finish.min_new_tokens:
            return []
        # The tokens it samples from now on: the one in flight, the draft step's, and the draft's
        limit = min(limit, self.drafter.tokens, req.finish.max_new_tokens - len(req.output) - req.awaiting - 1)
        if limit < 1:
            return []
        if req.ngrams is None:
            req.ngrams = self.drafter.index()
        req.ngrams.extend(req.known(len(req.ngrams.tokens), req.num_known))
        return req.ngrams.draft(limit)

    def add(self, req: Request, draft: Planning, rows: int) -> int:
        """Give the decode just planned for `req` (of its last known output token) a draft, within
        the budget, `rows` sampled rows and the free (or evictable) pages; returns its length."""
        seq = draft.seqs.get(req.rid)
        if self.drafter is None or seq is None or seq.follows or seq.start < len(req.prompt) or seq.context_len != req.num_known:
            return 0
        tokens = self.drafts(req, min(draft.budget, rows))
        missing = self.pages.pages_for(seq.context_len + len(tokens)) - len(req.pages)
        if not tokens or missing > 0 and not self.pages.allocate(req, missing):
            return 0
        draft.seqs[req.rid] = dataclasses.replace(seq, tokens=seq.tokens + tokens, drafts=len(tokens))
        req.drafted = len(tokens)
        draft.budget -= len(tokens)
        return len(tokens)

    def verified(self, seq: PlannedSeq, sampled: list[tuple[int, float]]) -> None:
        """Check a seq's sampled tokens: one, or a draft's verified ones, whose accepted tokens'
        positions are now computed, the pages past them freed (when still running: a retracted
        request recomputes anyway), and counted."""
        req, accepted = seq.request, len(sampled) - 1
        draft = seq.tokens[len(seq.tokens) - seq.drafts :] if seq.drafts else []
        if not 0 <= accepted <= seq.drafts or [t for t, _ in sampled[:accepted]] != draft[:accepted]:
            raise ValueError(f"request {req.rid!r}: {len(sampled)} tokens {[t for t, _ in sampled]} do not verify its draft {draft}")
        if not seq.drafts:
            return
        if req.drafted:
            req.computed += accepted
            req.drafted = 0
            self.pages.trim(req)
        self.counters.spec_decode_num_drafts_total += 1
        self.counters.spec_decode_num_draft_tokens_total += seq.drafts
        self.counters.spec_decode_num_accepted_tokens_total += accepted
