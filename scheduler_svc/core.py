"""The scheduling policy: which requests run in the next step, which of their tokens, in which KV pages.

Pure: plain objects in, a plain plan out; no clock, no I/O (STYLE 3). The life of a request:

1. `add` puts it at the back of the waiting queue.
2. `plan` admits it when a running slot, the step's token budget and pages allow: in queue order
   (`fcfs`), or the waiting request with the longest cached prefix first (`lpm`, see `_candidates`).
   With a prefix cache (radix.py) it first takes the longest cached page-aligned prefix of its
   known tokens: those pages are pinned (shared, never written again) and `computed` starts after
   them. It always leaves at least one token to feed (the step that feeds the last known token
   samples), and stops at or before the first prompt position it must still score (6.). Its prompt
   is then fed in chunks of at most the budget left in the step (chunked prefill); the chunk that
   feeds its last known token samples. Running requests that are decoding go first in every step,
   so prompts never stall them. The prefix it reused at its first feed is its `cached_tokens`.
   A hybrid model's hit and chunks also follow its state snapshots' rules (snapshots.py).
   Admitted, it takes a free `slot`; its first seq `takes_slot` (the worker keeps its sampling
   parameters by slot from then on, so they travel once per admission, not in every step).
3. `absorb` appends the sampled token; from then on each step feeds the request that token (decode)
   until the shared finish rule (`jaxstream.stopping`) ends it, or `abort` / `finish` does.
   Overlap: a plan made while the request's sampled token is still in flight (the caller plans step
   N + 1 before step N's result) feeds it that token unseen: a one-token seq that `follows` (the
   worker takes the token its `slot` sampled in the step before), unless the token in flight is its
   last allowed (max_new_tokens). If that token ends the request, the step after computed one token
   for nothing; `absorb` drops its result. At most one sample of a request is planned ahead.
4. Each `plan` first hands the cache the whole pages that earlier steps computed for running
   requests (prompt and output), so later admissions share them; a page the cache already held is
   swapped for the cache's and freed. A request that ends, or is retracted, gives the cache its
   last whole pages too, frees its partial last page and drops its pins.
5. When pages run out, unpinned cache pages are evicted, least recently used first; only when none
   is left is the most recently admitted request retracted: it gives its pages to the cache, goes
   back to the front of the queue and keeps its output. Readmitted, it takes what the cache still
   holds of its prefix and recomputes the rest, and the chunk that feeds its last known token
   samples: the same token its next decode would have sampled.
6. Prompt logprobs ride on the steps that feed the prompt: a step feeding positions [p0, c) can score
   prompt positions p0 + 1 .. c (position q is predicted by the logits at q - 1; c is the known token
   after the chunk, `next_token`), and position 0 itself when p0 == 0. Each position is asked for once:
   `scored_to` remembers how far, so a recompute after retraction re-feeds without re-scoring. A
   prefix taken from the cache is never fed, so it ends at or before max(q - 1, 0) for the first
   position q still to score.
7. A request that asks for no token (max_new_tokens 0: SGLang's prefill-only request, which scores
   its prompt) is admitted, cached and chunked like any other, but the chunk that feeds its last
   prompt token does not sample: it `ends` the request, and `absorb` of that step's result finishes
   it with length 0 (`jaxstream.stopping.prefill_only`, the detokenizer's rule too). Not sampling,
   rather than sampling a token and dropping it, keeps every result free of tokens nobody asked for.
8. Speculative decoding (with a `drafter`; speculation.py tells the whole rule): a decode that
   feeds its last known output token may carry a draft of its next tokens, which the worker
   verifies; `absorb` takes its tokens up to the first that differs from the draft's. A request with
   a draft in flight is not planned again until its result is absorbed.

Invariants (the tests check them after every step):
- A request's known tokens are prompt + output. `computed` of them have KV, or will have once the
  planned steps run; computed exceeds the known tokens by one while a seq that follows is in flight
  (its input is the token not absorbed yet). `drafted` positions past them are being written by a
  draft in flight (8.). Running: exactly ceil((computed + drafted) / page_size) pages, page
  i holding positions [i * page_size, (i + 1) * page_size); its first `shared` pages are the path it
  pins in the cache, the rest its own; a `slot` in [0, max_running) no other running request has.
  Waiting: no pages, no pins, no slot, computed == 0.
- Every allocated page is either in the cache or owned by exactly one running request.
- A cache page's pin count is the number of running requests whose shared pages hold it.
- A step feeds at most token_budget tokens; at most max_running requests run.
- A request is never retracted in favour of one admitted after it, so the oldest always progresses.
  Under fcfs, requests are admitted in arrival order (retracted ones first). lpm relaxes that
  order only: a request heading the queue is overtaken at most LPM_WINDOW times.
- A step only reads cache pages that steps published before it wrote (the worker runs steps in
  order): pages join the cache at the start of the plan after the one that computed them, or when
  their request ends or is retracted, never while the step writing them is being planned.
- At idle every page is free or held by the cache, and nothing in the cache is pinned.
- No prompt position is asked to be scored twice; together the steps ask for every position from
  `prompt_logprobs_from` on.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque

from jaxstream.english import counted
from jaxstream.protocol import FinishReason
from jaxstream.scoring import window
from jaxstream.stopping import finish_reason, prefill_only
from scheduler_svc.counters import Counters
from scheduler_svc.ngram import NgramDrafter
from scheduler_svc.pages import PageAllocator
from scheduler_svc.radix import RadixCache
from scheduler_svc.request import FOLLOWS, Finished, PlannedSeq, Planning, Request, StepPlan
from scheduler_svc.request_pages import RequestPages
from scheduler_svc.speculation import Speculation

__all__ = ["Busy", "FOLLOWS", "Finished", "PlannedSeq", "QueueFull", "Request", "Scheduler", "StepPlan", "Unschedulable"]

POLICIES = ("fcfs", "lpm")
# lpm looks at this many requests at the head of the queue (beyond it, queue order: matching every
# waiting prompt each step would cost more than it saves), and admits the head once this many
# requests were admitted before it while it was the head: no request waits forever.
LPM_WINDOW = 128


class Unschedulable(ValueError):
    """A request that could never run, whatever else is running."""


class QueueFull(Exception):
    """Too many requests are waiting already: refuse this one for now (the client may retry)."""


class Busy(Exception):
    """The prefix cache cannot be flushed while requests run or wait."""



class Scheduler:
    def __init__(self, *, max_running: int, token_budget: int, page_size: int, allocator: PageAllocator,
                 max_queued: int | None = None, cache: RadixCache | None = None, policy: str = "fcfs",
                 drafter: NgramDrafter | None = None, state_slots: bool = False) -> None:
        """`cache`: the prefix cache, over the same allocator and page size; None: none. `drafter`: speculative
        decoding's drafts (8.); None: none. `state_slots`: a hybrid's states live in its `slot`'s row (stats)."""
        if min(max_running, token_budget, page_size) < 1:
            raise ValueError(f"need max_running, token_budget, page_size >= 1, got "
                             f"{max_running}, {token_budget}, {page_size}")
        if max_queued is not None and max_queued < 1:
            raise ValueError(f"need max_queued >= 1 or None (no limit), got {max_queued}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if cache is not None and (cache.allocator is not allocator or cache.page_size != page_size):
            raise ValueError("the prefix cache must use the scheduler's allocator and page size")
        self.max_running = max_running
        self.token_budget = token_budget
        self.page_size = page_size
        self.allocator = allocator
        self.max_queued = max_queued
        self.cache = cache
        self.policy = policy
        self.counters = Counters()
        self.pages = RequestPages(allocator, cache, page_size)
        self.speculation = Speculation(drafter, self.pages, self.counters)
        self._waiting: deque[Request] = deque()
        self._running: dict[str, Request] = {}  # in admission order: the last is the first retracted
        self._free_slots = list(range(max_running - 1, -1, -1))  # popped from the end: lowest first
        self.state_slots = state_slots
        self._live: dict[str, Request] = {}  # waiting and running, by rid

    def add(self, req: Request) -> None:
        """Queue a request. ValueError: its rid is taken; Unschedulable: it could never run;
        QueueFull: `max_queued` requests are waiting already (retracted ones included)."""
        if req.rid in self._live:
            raise ValueError(f"request id {req.rid!r} is already scheduled")
        if not req.prompt:
            raise Unschedulable("the prompt is empty: there is no token to sample after")
        # Enough for the prompt's KV and one decode (none for a request that samples nothing); whether
        # more fits depends on when it stops.
        decode = int(prefill_only(req.finish) is None)
        need = self.pages.pages_for(len(req.prompt) + decode)
        if need > self.allocator.num_pages:
            raise Unschedulable(
                f"a prompt of {counted(len(req.prompt), 'token')} needs {counted(need, 'KV page')} of "
                f"{counted(self.page_size, 'token')} (prompt{' + 1' * decode}), more than the whole pool of "
                f"{counted(self.allocator.num_pages, 'page')}")
        if self.max_queued is not None and len(self._waiting) >= self.max_queued:
            raise QueueFull(f"the server is busy: {counted(len(self._waiting), 'request')} waiting, the limit "
                            f"(scheduler.max_queued_requests) is {self.max_queued}; retry later")
        self._waiting.append(req)
        self._live[req.rid] = req
        self.counters.requests_total += 1

    def plan(self, admit: bool = True, now: float = 0.0) -> StepPlan | None:
        """The next step; None when nothing can run. `admit=False`: only requests already running
        progress (a weight update drains them before it swaps). `now`: the caller's clock, for the
        request timing histograms (Counters)."""
        draft = Planning(budget=self.token_budget, now=now)
        # 0. Whole pages computed by earlier steps join the cache: admissions below may share them.
        self.pages.cache_running(self._running.values())
        # 1. Decodes: one token each for requests whose every known token but the last has KV, or
        #    whose next token is in flight (overlap), unless it would rather draft next step; and
        #    drafts, from sampled rows no running or waiting request needs (8.).
        rows = self.max_running - len(self._running) - (len(self._waiting) if admit else 0)
        for req in [r for r in self._running.values() if r.pending == 1 or self._may_follow(r)]:
            if not (rows > 0 and req.pending == 0 and self.speculation.drafts(req, 1)):  # no waiting for a draft without room
                self._schedule(req, draft)
                rows -= self.speculation.add(req, draft, rows)
        # 2. Prompt chunks of admitted requests (a long prompt, or a recompute after retraction).
        for req in [r for r in self._running.values() if r.pending > 1]:
            self._schedule(req, draft)
        # 3. Admit, in the policy's order. Not after a retraction: the pool is short, and the request
        #    just retracted would come straight back. Not a request whose sampled token (or end, 7.)
        #    is still in flight (retracted mid-step): recomputing now would sample the same position
        #    twice; under fcfs such a head holds back those behind it.
        for req in self._candidates() if admit else ():
            if len(self._running) >= self.max_running or draft.budget == 0 or draft.retracted:
                break
            if req.awaiting:
                if self.policy == "fcfs" or self.cache is None:
                    break
                continue
            if req is not self._waiting[0]:
                self._waiting[0].overtaken += 1
            self._waiting.remove(req)
            self._running[req.rid] = req
            req.slot = self._free_slots.pop()
            self.pages.admit(req)
            self._schedule(req, draft)
            if req.rid in draft.seqs:  # else it yielded at once (no pages): it takes a slot again later
                draft.seqs[req.rid] = dataclasses.replace(draft.seqs[req.rid], takes_slot=True)
        if not draft.seqs and not draft.ended:
            return None
        # Only now is the plan final (a retraction may have taken a seq back out): commit what it asks.
        seqs = [self._commit(seq, now) for seq in draft.seqs.values()]
        return StepPlan(seqs, draft.ended)

    def absorb(self, plan: StepPlan, results: dict[str, tuple[int, float] | list[tuple[int, float]]],
               now: float = 0.0) -> list[Finished]:
        """Append the tokens sampled by `plan` (rid -> (token id, logprob), or a list of them for a
        seq with a draft: its verified tokens, 8.); return what finished: by a token, or by the step
        that fed the whole prompt of a request that samples nothing (7.). `now`: the caller's clock,
        as for `plan`."""
        finished = []
        tokens = 0  # vLLM's iteration tokens: each request's whole prompt with its first token, and every token sampled
        for seq in plan.seqs:
            req = seq.request
            # Skip prompt chunks, requests ended while the step was in flight (the rid may even be
            # reused by now, hence `is`), and a result delivered twice (no longer awaiting; with two
            # steps in flight the caller must absorb each plan once, in order).
            if not (seq.sample or seq.ends) or self._live.get(req.rid) is not req or not req.awaiting:
                continue
            req.awaiting -= 1
            if seq.ends:
                reason = prefill_only(req.finish)
            else:
                if req.rid not in results:
                    raise KeyError(f"the step's results have no token for {req.rid!r}, which sampled")
                sampled = results[req.rid]
                sampled = [sampled] if isinstance(sampled, tuple) else sampled
                self.speculation.verified(seq, sampled)
                if req.first_token < 0:
                    req.first_token = now
                    tokens += len(req.prompt)
                for token, logprob in sampled:  # more than one only for a draft
                    req.output.append(token)
                    req.logprobs.append(logprob)
                    self.counters.generation_tokens_total += 1
                    tokens += 1
                    reason = finish_reason(token, len(req.output), req.finish)
                    if reason is not None:
                        break
            if reason is not None:
                self._drop(req)
                self.counters.ended(req, now)
                finished.append(Finished(req, reason))
        # As vLLM observes iteration_tokens_total (vllm/v1/metrics/loggers.py, from IterationStats
        # in stats.py): once per step's result, its prompt tokens (a request's whole prompt, cached
        # part included, in the step that brings its first token) plus its sampled tokens.
        self.counters.iteration_tokens_total.observe(tokens)
        return finished

    def abort(self, rid: str) -> Request | None:
        """End a waiting or running request; None when unknown or already ended (idempotent). Safe
        while a step naming it is in flight: the worker runs that step before any step that reuses
        its pages, and `absorb` ignores its result."""
        req = self._live.get(rid)
        if req is not None:
            self._drop(req)
            self.counters.aborted_total += 1
        return req

    def finish(self, rid: str, now: float = 0.0) -> Request | None:
        """The detokenizer matched a stop string: end the request as `abort` does, counted as
        ended by its finish rule (`now`: as for `plan`)."""
        req = self._live.get(rid)
        if req is not None:
            self._drop(req)
            self.counters.ended(req, now)
        return req

    def rids(self) -> list[str]:
        """Every request not yet ended, waiting or running."""
        return list(self._live)

    @property
    def running(self) -> list[Request]:  # in admission order
        return list(self._running.values())

    @property
    def waiting(self) -> list[Request]:  # in queue order
        return list(self._waiting)

    def stats(self) -> dict[str, int | float | str]:
        """Gauges, limits and the cumulative counters and histograms (the gateway's /metrics and
        /v1/loads; jaxstream/histogram.py says how a histogram travels).
        `pages_used` counts the cache's pages too; `pages_evictable` of those are pinned by nobody,
        free for the taking when pages run short. A hybrid's state slots and snapshots too."""
        a, c = self.allocator, self.cache
        limits = {"max_running_requests": self.max_running, "max_total_tokens": a.num_pages * self.page_size}
        if self.max_queued is not None:
            limits["max_queued_requests"] = self.max_queued
        if self.state_slots:  # a row per slot, held by the running request in it
            free = len(self._free_slots)
            limits |= {"state_slots_total": self.max_running, "state_slots_used": self.max_running - free, "state_slots_free": free}
        limits |= self.pages.snapshots.stats() if self.pages.snapshots else {}
        return {"running": len(self._running), "waiting": len(self._waiting),
                "pages_used": a.num_used, "pages_free": a.num_free, "pages_total": a.num_pages,
                "pages_cached": c.num_pages if c else 0, "pages_evictable": c.num_evictable if c else 0,
                "page_size": self.page_size, "prefix_cache": int(c is not None), **limits, **self.counters.stats(),
                "spec_decode_acceptance_rate": self.counters.acceptance_rate()}

    def check_idle(self) -> str | None:
        """At idle every page must be free or held by the prefix cache, unpinned; an error message
        when one is not (a leak), else None."""
        if self._live:
            return None
        cached = self.cache.num_pages if self.cache else 0
        if self.allocator.num_used != cached:
            return (f"idle, yet {self.allocator.num_used - cached} of {self.allocator.num_pages} KV pages are allocated "
                    f"outside the prefix cache")
        if self.cache and self.cache.num_pinned:
            return f"idle, yet {self.cache.num_pinned} prefix cache pages are pinned"
        return None

    def retract_all(self) -> int:
        """Send every running request back to the front of the queue, newest first, as when pages
        run out (pause mode `retract`): its KV goes to the cache or is freed, its output is kept,
        and readmitted it recomputes. Returns how many."""
        running = list(self._running.values())
        draft = Planning(budget=0)
        for req in reversed(running):
            self._retract(req, draft)
        return len(running)

    def flush_cache(self, waiting_too: bool = True) -> int:
        """Empty the prefix cache (SGLang's /flush_cache); only when no request runs, nor waits
        unless `waiting_too` is False (paused: a waiting request holds no page), never aborting one
        (Busy otherwise). Returns the pages freed."""
        if self._running or (waiting_too and self._waiting):
            raise Busy(f"{counted(len(self._running), 'request')} running and {len(self._waiting)} waiting")
        return self.cache.flush() if self.cache else 0

    def invalidate_cache(self) -> None:
        """The worker that computed the KV is gone (a new one has an empty cache): forget every cached
        page, and never cache what running requests computed so far."""
        if self.cache is None:
            return
        for req in self._running.values():
            req.kv_lost = True
        self.cache.invalidate()

    # -- internals

    def _may_follow(self, req: Request) -> bool:
        """Its every known token is fed and the next is in flight, which may not be its last (and
        is not a draft's, whose count is unknown)."""
        return req.pending == 0 and req.awaiting == 1 and not req.drafted and len(req.output) + 1 < req.finish.max_new_tokens

    def _schedule(self, req: Request, draft: Planning) -> None:
        """Plan the next min(pending, budget) known tokens of a running request, or the token in flight
        when it may follow, if it gets the pages."""
        if self._running.get(req.rid) is not req or draft.budget == 0:
            return  # retracted earlier in this plan, or the step is full
        start, follows = req.computed, req.pending == 0
        n, saves = (1, False) if follows else self.pages.chunk(req, min(req.pending, draft.budget))  # a hybrid's ends where its state is kept
        if not self._reserve(req, start + n, draft):
            return
        tokens = [FOLLOWS] if follows else req.known(start, start + n)
        fed = start + n == req.num_known  # every known token (never so for one that follows)
        ends = fed and prefill_only(req.finish) is not None  # a request that samples nothing (7.)
        draft.seqs[req.rid] = PlannedSeq(req, start, tokens, follows or (fed and not ends), follows=follows, ends=ends, saves=saves)
        req.computed += n
        draft.budget -= n

    def _reserve(self, req: Request, num_tokens: int, draft: Planning) -> bool:
        """Pages for positions [0, num_tokens) of `req`, allocated only now that a step writes them.
        When the pool is short, retract the most recently admitted request if it came after `req`;
        otherwise `req` yields. False when `req` is no longer running."""
        while (missing := self.pages.pages_for(num_tokens) - len(req.pages)) > 0:
            if self.pages.allocate(req, missing):  # free pages, else unpinned cache pages: before any request's
                return True
            latest = next(reversed(self._running.values()))
            if latest is not req:
                self._retract(latest, draft)  # each pass removes one: the loop ends
            elif len(self._running) > 1:
                self._retract(req, draft)  # older requests hold the pages; they have priority
                return False
            else:
                # Alone, it holds every page in use and still needs more: it can never progress.
                self._drop(req)
                draft.ended.append(Finished(req, FinishReason("length", length=len(req.output))))
                self.counters.ended(req, draft.now)
                return False
        return True

    def _commit(self, seq: PlannedSeq, now: float) -> PlannedSeq:
        """The seq as published: its request now awaits its sample (or its end), its prompt is
        counted, and the prompt positions this step scores are marked asked (StepSeq's score_from rule)."""
        req = seq.request
        req.awaiting += seq.sample or seq.ends
        n, p0, end = len(req.prompt), seq.start, seq.context_len
        first = not req.prefilled
        if first:  # positions [0, p0) came from the cache
            req.cached_tokens = p0
            req.scheduled = now
            self.counters.prefix_cache_queries_total += n
            self.counters.prefix_cache_hits_total += p0
        from_cache, req.reused = req.reused > 0, -1
        self.counters.prompt_tokens_total += max(min(end, n) - max(req.fed_to, p0), 0)
        req.fed_to = max(req.fed_to, end)
        # Of the positions this step's logits can score (jaxstream.scoring), the ones not asked for yet.
        can = window(p0, end, n)
        lo, hi = max(req.prompt_logprobs_from, req.scored_to, can.start), can.stop
        score_from = -1
        if req.prompt_logprobs_from >= 0 and lo < hi:
            score_from, req.scored_to = lo, hi
        return dataclasses.replace(seq, score_from=score_from, next_token=req.prompt[end] if end < n else -1,
                                   first=first, from_cache=from_cache, **self.pages.snapshot_rows(seq, from_cache))

    def _candidates(self) -> list[Request]:
        """Waiting requests in the order admission tries them: fcfs, queue order; lpm, the first
        LPM_WINDOW by the length of their cached prefix, longest first, queue order among equals
        (and queue order once the head was overtaken LPM_WINDOW times), then the rest in queue order."""
        # Each candidate is admitted or ends the admissions, but for lpm's skipped awaiting ones.
        if self.policy == "fcfs" or self.cache is None or not self._waiting:
            return list(itertools.islice(self._waiting, self.max_running))
        window = list(itertools.islice(self._waiting, LPM_WINDOW))
        if window[0].overtaken < LPM_WINDOW:
            hit = {id(r): len(self.cache.match(r.known(0, self.pages.reusable(r)), touch=False, namespace=r.namespace)[1])
                   for r in window}
            window.sort(key=lambda r: -hit[id(r)])
        return window + list(itertools.islice(self._waiting, LPM_WINDOW, LPM_WINDOW + self.max_running))

    def _retract(self, req: Request, draft: Planning) -> None:
        """Drop a running request's KV (to the cache) and requeue it at the front; it keeps its output."""
        planned = draft.seqs.pop(req.rid, None)
        if planned is not None:  # planned earlier in this step: take it back out, it computes nothing
            draft.budget += len(planned.tokens)
            req.computed = planned.start
        del self._running[req.rid]
        self.pages.release(req)
        req.computed = 0
        self._free_slots.append(req.slot)
        req.slot = -1
        # Requests are retracted newest first, so pushing each to the front keeps admission order.
        self._waiting.appendleft(req)
        draft.retracted = True
        self.counters.preempted_total += 1

    def _drop(self, req: Request) -> None:
        del self._live[req.rid]
        if self._running.pop(req.rid, None) is None:
            self._waiting.remove(req)
        else:
            self._free_slots.append(req.slot)
            req.slot = -1
        self.pages.release(req)
