"""The scheduling policy, driven by plain lists of ints and a deterministic fake worker.

The fake worker writes every fed token into a paged cache through the request's pages (as the real
worker writes KV) and samples from the context it reads back through them. So a wrong page table, a
page shared by two requests, or a token recomputed at the wrong position shows up as a wrong token.
"""

import math
import random

import pytest

from jaxstream.protocol import Constraint, FinishReason, FinishRule, SamplingParams
from scheduler_svc import core
from scheduler_svc.core import Busy, Finished, PlannedSeq, QueueFull, Request, Scheduler, StepPlan, Unschedulable
from scheduler_svc.ngram import NgramDrafter
from scheduler_svc.pages import PageAllocator
from scheduler_svc.radix import RadixCache

VOCAB = 1000


def last_plus_position(context: list[int]) -> int:
    """Next token from the token at the last position and that position only."""
    return (context[-1] + len(context) - 1) % VOCAB


def context_hash(context: list[int]) -> int:
    """Next token from the whole context: any wrong KV anywhere changes it."""
    h = 0
    for t in context:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


def mostly_copying(context: list[int]) -> int:
    """Next token: the one 5 positions back, but where the whole context's hash says otherwise (a
    quarter of the time): n-gram drafts are often right, and any wrong KV still shows."""
    h = context_hash(context)
    return context[-5] if len(context) >= 5 and h % 4 else h


def reference(prompt: list[int], n: int, next_token=context_hash) -> list[int]:
    """What a request generates alone, computed without any scheduler."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def asked(q: PlannedSeq) -> list[int]:
    """The prompt positions a published seq asks to score, by StepSeq's rule (protocol.py)."""
    if q.score_from < 0:
        return []
    n = len(q.request.prompt)
    return [0] * (q.score_from == 0 == q.start) + list(range(max(q.score_from, q.start + 1), min(q.context_len + 1, n)))


class FakeWorker:
    def __init__(self, page_size: int, next_token=context_hash):
        self.page_size = page_size
        self.next_token = next_token
        self.cache: dict[tuple[int, int], int] = {}  # (page, slot) -> token
        self.scored: dict[str, list[int]] = {}  # rid -> prompt positions scored, in order
        self.slots: dict[int, int] = {}  # slot -> the token sampled there last (a seq that follows feeds it)
        self.params: dict[int, str] = {}  # slot -> the request whose sampling parameters it holds

    def run(self, plan: StepPlan) -> dict[str, tuple[int, float]]:
        """Run a step as published: with the page table as it is when `plan` is returned."""
        results = {}
        ps = self.page_size
        for seq in plan.seqs:
            # As worker_svc/slots.py: a request's parameters come with its first seq in its slot.
            if seq.takes_slot:
                self.params[seq.request.slot] = seq.request.rid
            assert self.params.get(seq.request.slot) == seq.request.rid, f"{seq.request.rid}: slot without its parameters"
            pages = list(seq.request.pages)
            fed = [self.slots[seq.request.slot]] if seq.follows else seq.tokens
            for i, token in enumerate(fed):
                pos = seq.start + i
                self.cache[pages[pos // ps], pos % ps] = token
            prompt = seq.request.prompt
            assert seq.next_token == (prompt[seq.context_len] if seq.context_len < len(prompt) else -1)
            for q in asked(seq):  # the token scored at q: fed this step, or the one right after it
                target = seq.tokens[q - seq.start] if q < seq.context_len else seq.next_token
                assert target == prompt[q]
                done = self.scored.setdefault(seq.request.rid, [])
                assert q not in done, f"position {q} of {seq.request.rid} scored twice"
                done.append(q)
            if seq.sample:
                # A draft (core.py 8.): sample after each of its last drafts + 1 tokens, up to the first
                # sample that differs from the draft's next token, as the worker does.
                draft = seq.tokens[len(seq.tokens) - seq.drafts :]
                sampled = []
                for j in range(seq.drafts + 1):
                    end = seq.context_len - seq.drafts + j
                    token = self.next_token([self.cache[pages[p // ps], p % ps] for p in range(end)])
                    sampled.append((token, -token / VOCAB))
                    if j == seq.drafts or token != draft[j]:
                        break
                results[seq.request.rid] = sampled if seq.drafts else sampled[0]
                if not seq.drafts:
                    self.slots[seq.request.slot] = token
        return results


def req(rid, prompt, max_new=4, stop=(), min_new=0, score_from=-1) -> Request:
    return Request(rid=rid, gateway="g0", prompt=list(prompt),
                   sampling=SamplingParams(max_new_tokens=max_new, prompt_logprobs_from=score_from),
                   finish=FinishRule(tuple(stop), max_new, min_new))


def make(max_running=8, token_budget=64, page_size=4, num_pages=256, max_queued=None, cache=False, policy="fcfs",
         drafter=None, state_slots=False) -> Scheduler:
    allocator = PageAllocator(num_pages)
    return Scheduler(max_running=max_running, token_budget=token_budget, page_size=page_size, allocator=allocator,
                     max_queued=max_queued, cache=RadixCache(page_size, allocator) if cache else None, policy=policy,
                     drafter=drafter, state_slots=state_slots)


def check_state(s: Scheduler) -> None:
    """The core's invariants, from the outside."""
    running, waiting = s.running, s.waiting
    assert len(running) <= s.max_running
    owned = [p for r in running for p in r.pages[r.shared:]]
    assert len(owned) == len(set(owned)), "a page is owned by two requests"
    tree = {n.page: n for n in s.cache.nodes()} if s.cache else {}
    assert not set(owned) & set(tree), "a page is both a request's own and the cache's"
    cached = s.cache.num_pages if s.cache else 0  # stale pinned paths (invalidate) included
    assert s.allocator.num_used == len(owned) + cached
    refs = {page: 0 for page in tree}
    slots = [r.slot for r in running]
    assert len(set(slots)) == len(slots) and all(0 <= k < s.max_running for k in slots)
    for r in running:
        assert len(r.pages) == math.ceil((r.computed + r.drafted) / s.page_size)
        assert not r.drafted or r.awaiting == 1, "a request with a draft in flight is planned again"
        assert 0 < r.computed <= r.num_known + (r.awaiting == 2), "only a seq that follows feeds an unknown token"
        if s.cache is None:
            assert r.shared == 0 and r.node is None
            continue
        path = list(reversed(r.node.path()))
        assert [n.page for n in path] == r.pages[: r.shared], "a request's shared pages are not its pinned path"
        for n in path:
            if not n.stale:
                refs[n.page] += 1
    for page, node in tree.items():
        assert node.refs == refs[page], f"cache page {page} has {node.refs} pins, {refs[page]} requests read it"
    for r in waiting:
        assert r.pages == [] and r.computed == 0 and r.shared == 0 and r.node is None and r.slot == -1
    assert sorted(s.rids()) == sorted(r.rid for r in running + waiting)
    st = s.stats()
    assert st | {"running": len(running), "waiting": len(waiting), "pages_used": len(owned) + cached,
                 "pages_free": s.allocator.num_pages - len(owned) - cached, "pages_total": s.allocator.num_pages,
                 "pages_cached": cached, "max_running_requests": s.max_running,
                 "max_total_tokens": s.allocator.num_pages * s.page_size} == st
    for r in running + waiting:
        assert r.prefilled == (r.fed_to > 0) and r.fed_to >= r.computed


def check_plan(s: Scheduler, plan: StepPlan) -> None:
    assert sum(len(q.tokens) for q in plan.seqs) <= s.token_budget
    assert sum(q.sample + q.drafts for q in plan.seqs) <= s.max_running, "more sampled rows than the worker has"
    rids = [q.request.rid for q in plan.seqs]
    assert len(rids) == len(set(rids))
    for q in plan.seqs:
        r = q.request
        assert r in s.running and q.tokens
        assert r.computed + r.drafted == q.context_len  # advanced at plan time
        assert r.drafted == q.drafts
        if q.drafts:  # after the last known output token, a draft
            assert q.sample and not q.follows and q.start >= len(r.prompt) and q.context_len - q.drafts == r.num_known
            assert len(r.output) + 1 + q.drafts <= r.finish.max_new_tokens and len(r.output) >= r.finish.min_new_tokens
            assert q.tokens[: -q.drafts] == (r.prompt + r.output)[q.start:]
            continue
        if q.follows:  # the token in flight, which the worker takes from the slot
            assert q.tokens == [core.FOLLOWS] and q.sample and q.context_len == r.num_known + 1 and r.awaiting == 2
            continue
        assert q.tokens == (r.prompt + r.output)[q.start:q.context_len]
        # the step that feeds the last known token samples, but for a request that asked for none: it ends it
        assert q.ends == (q.context_len == r.num_known and r.finish.max_new_tokens == 0)
        assert q.sample == (q.context_len == r.num_known and not q.ends)
        assert q.start >= r.shared * s.page_size, "a step writes into a page of the prefix cache"


def drive(s: Scheduler, worker: FakeWorker, max_steps=5000, plans=None, depth=1) -> dict[str, Finished]:
    """plan, run, absorb until idle, with up to `depth` steps planned before the oldest is absorbed
    (2: the scheduler service's overlap); check invariants at every step."""
    done: dict[str, Finished] = {}
    in_flight: list[tuple[StepPlan, dict]] = []
    for _ in range(max_steps):
        plan = s.plan()
        if plan is None and not in_flight:
            break
        if plan is not None:
            check_plan(s, plan)
            check_state(s)
            if plans is not None:
                plans.append(plan)
            for f in plan.ended:
                done[f.request.rid] = f
            in_flight.append((plan, worker.run(plan)))
        if len(in_flight) >= depth or plan is None:
            for f in s.absorb(*in_flight.pop(0)):
                assert f.request.rid not in done
                done[f.request.rid] = f
            check_state(s)
    else:
        raise AssertionError("the scheduler did not go idle")
    assert s.running == [] and s.waiting == []
    assert s.check_idle() is None
    if s.cache is not None:
        assert s.cache.num_pinned == 0 and s.allocator.num_used == s.cache.num_pages
    return done


# ---------------------------------------------------------------------------------------------


def test_fcfs_order_and_max_running():
    s = make(max_running=2)
    for i in range(5):
        s.add(req(f"r{i}", [i + 1] * 3, max_new=3))
    plans: list[StepPlan] = []
    done = drive(s, FakeWorker(4), plans=plans)
    first_seen: list[str] = []
    for plan in plans:
        assert len(plan.seqs) <= 2
        for q in plan.seqs:
            if q.request.rid not in first_seen:
                first_seen.append(q.request.rid)
    assert first_seen == ["r0", "r1", "r2", "r3", "r4"]
    # r2 starts only when r0 and r1 are done (they need the same number of steps).
    step_r2 = next(i for i, p in enumerate(plans) if any(q.request.rid == "r2" for q in p.seqs))
    assert all(not any(q.request.rid in ("r0", "r1") for q in p.seqs) for p in plans[step_r2:])
    assert all(len(f.request.output) == 3 for f in done.values())


def test_token_budget_is_respected_and_filled():
    s = make(max_running=4, token_budget=7)
    for i in range(6):
        s.add(req(f"r{i}", range(10 * i, 10 * i + 5 + 3 * i), max_new=5))
    worker = FakeWorker(4)
    sizes = []
    while (plan := s.plan()) is not None:
        n = sum(len(q.tokens) for q in plan.seqs)
        assert n <= 7
        if n < 7:  # budget left over only when nothing else could run
            assert all(r.pending == 0 for r in s.running)
            assert not s.waiting or len(s.running) == s.max_running
        sizes.append(n)
        for f in s.absorb(plan, worker.run(plan)):
            assert f.request.output == reference(f.request.prompt, 5)
    assert sizes.count(7) >= 5 and len(sizes) > 10
    assert s.check_idle() is None


def test_chunked_prefill_samples_only_on_last_chunk():
    s = make(token_budget=10)
    r = req("long", range(1, 26), max_new=2)
    s.add(r)
    worker = FakeWorker(4)
    chunks = []
    for _ in range(3):
        plan = s.plan()
        (q,) = plan.seqs
        chunks.append((q.start, len(q.tokens), q.sample))
        assert s.absorb(plan, worker.run(plan)) == []
    assert chunks == [(0, 10, False), (10, 10, False), (20, 5, True)]
    assert len(r.output) == 1
    plan = s.plan()
    (q,) = plan.seqs
    assert (q.start, q.tokens, q.sample) == (25, [r.output[0]], True)  # the decode


def test_chunked_prefill_over_many_steps_gives_reference_tokens():
    for budget in (1, 3, 8, 100):
        s = make(token_budget=budget, page_size=3)
        s.add(req("a", range(40, 71), max_new=6))
        done = drive(s, FakeWorker(3))
        assert done["a"].request.output == reference(list(range(40, 71)), 6)


def test_decode_and_prefill_mixed_in_one_step():
    s = make(token_budget=8)
    worker = FakeWorker(4)
    s.add(req("short", [7, 8], max_new=10))
    plan = s.plan()
    s.absorb(plan, worker.run(plan))
    s.add(req("long", range(100, 120), max_new=2))
    plan = s.plan()
    kinds = [(q.request.rid, len(q.tokens), q.sample) for q in plan.seqs]
    assert kinds == [("short", 1, True), ("long", 7, False)]  # decode first, prompt fills the rest
    s.absorb(plan, worker.run(plan))
    plan = s.plan()
    assert [(q.request.rid, len(q.tokens)) for q in plan.seqs] == [("short", 1), ("long", 7)]


def test_pages_are_allocated_lazily():
    s = make(token_budget=8, page_size=4)
    worker = FakeWorker(4)
    r = req("a", range(20), max_new=6)
    s.add(r)
    counts = []
    while (plan := s.plan()) is not None:
        counts.append((r.computed, len(r.pages)))
        check_state(s)
        s.absorb(plan, worker.run(plan))
    # prefill chunks 8, 8, 4 then decodes at positions 20..24: a page only when a position enters it
    assert counts == [(8, 2), (16, 4), (20, 5), (21, 6), (22, 6), (23, 6), (24, 6), (25, 7)]
    assert r.output == reference(list(range(20)), 6) and r.pages == []
    assert s.check_idle() is None


def test_finish_on_max_new_tokens():
    s = make()
    s.add(req("a", [1, 2, 3], max_new=5))
    done = drive(s, FakeWorker(4))
    f = done["a"]
    assert f.finish == FinishReason("length", length=5)
    assert f.request.output == reference([1, 2, 3], 5) and len(f.request.logprobs) == 5
    assert f.request.pages == []


class ScriptedWorker:
    """Samples a fixed script per request: its n-th output token is script[n]."""

    def __init__(self, scripts):
        self.scripts = scripts

    def run(self, plan):
        return {q.request.rid: (self.scripts[q.request.rid][len(q.request.output)], -0.5)
                for q in plan.seqs if q.sample}


@pytest.mark.parametrize("min_new, max_new, expected_len, reason", [
    (0, 7, 2, "stop"), (2, 7, 2, "stop"), (3, 7, 5, "stop"), (6, 7, 7, "stop"), (6, 6, 6, "length"),
])
def test_finish_on_stop_token_respects_min_new_tokens(min_new, max_new, expected_len, reason):
    script = [4, 9, 4, 4, 9, 4, 9, 4, 4, 4]  # the stop token 9 is generated 2nd, 5th and 7th
    s = make()
    s.add(req("a", [1, 2], max_new=max_new, stop=(9,), min_new=min_new))
    worker = ScriptedWorker({"a": script})
    finished = []
    while (plan := s.plan()) is not None:
        finished += s.absorb(plan, worker.run(plan))
    (f,) = finished
    assert f.request.output == script[:expected_len]
    if reason == "stop":
        assert f.finish == FinishReason("stop", matched=9)
    else:  # every stop token came before min_new_tokens: max_new_tokens ends it
        assert f.finish == FinishReason("length", length=max_new)
    assert s.check_idle() is None


def test_abort_waiting_request():
    s = make(max_running=1)
    s.add(req("a", [1, 2], max_new=3))
    s.add(req("b", [3, 4], max_new=3))
    plan = s.plan()
    aborted = s.abort("b")
    assert aborted is not None and aborted.rid == "b" and s.waiting == []
    done = drive_from(s, plan)
    assert list(done) == ["a"]
    assert s.abort("b") is None  # idempotent


def drive_from(s, plan, worker=None):
    worker = worker or FakeWorker(s.page_size)
    done = {f.request.rid: f for f in s.absorb(plan, worker.run(plan))}
    done.update(drive(s, worker))
    return done


def test_abort_running_request_frees_its_pages_at_once():
    s = make(page_size=2)
    worker = FakeWorker(2)
    s.add(req("a", range(7), max_new=50))
    s.add(req("b", range(5), max_new=4))
    for _ in range(3):
        plan = s.plan()
        s.absorb(plan, worker.run(plan))
    used = s.stats()["pages_used"]
    a = s.abort("a")
    assert a.pages == [] and len(a.output) == 3 and len(a.logprobs) == 3
    assert s.stats()["pages_used"] == used - 5  # a had computed 9 tokens: 5 pages of 2
    done = drive(s, worker)
    assert list(done) == ["b"] and done["b"].request.output == reference(list(range(5)), 4)
    assert s.abort("a") is None and s.finish("a") is None


@pytest.mark.parametrize("how", ["abort", "finish"])
def test_end_while_step_in_flight_is_ignored_by_absorb(how):
    s = make(page_size=2)
    worker = FakeWorker(2)
    s.add(req("a", [5, 6, 7], max_new=10))
    s.add(req("b", [8, 9], max_new=3))
    plan = s.plan()
    results = worker.run(plan)  # the worker got the step...
    assert getattr(s, how)("a").rid == "a"  # ...then the request ended
    assert s.stats()["pages_used"] == 1  # b's page only
    # Its pages go to a newcomer in the next plan; the in-flight step's result for it is ignored.
    s.add(req("c", [1, 1, 1], max_new=3))
    assert s.absorb(plan, results) == []
    a = plan.seqs[0].request
    assert a.output == [] and a.pages == []
    done = drive(s, worker)
    assert sorted(done) == ["b", "c"]
    assert done["c"].request.output == reference([1, 1, 1], 3)
    assert s.abort("a") is None


def test_result_for_a_reused_rid_is_not_given_to_the_new_request():
    s = make()
    worker = FakeWorker(4)
    s.add(req("x", [1, 2, 3], max_new=1))  # its result would finish it
    plan = s.plan()
    results = worker.run(plan)
    old = s.abort("x")
    s.add(req("x", [9, 9], max_new=2))
    assert s.absorb(plan, results) == []
    assert old.output == [] and s.waiting[0].output == [] and s.rids() == ["x"]
    done = drive(s, worker)
    assert done["x"].request.output == reference([9, 9], 2)


def test_result_delivered_twice_is_absorbed_once():
    s = make()
    worker = FakeWorker(4)
    s.add(req("a", [1, 2], max_new=5))
    plan = s.plan()
    results = worker.run(plan)
    s.absorb(plan, results)
    s.absorb(plan, results)
    assert s.running[0].output == reference([1, 2], 1)


def test_missing_result_for_a_sampling_request_raises():
    s = make()
    s.add(req("a", [1, 2], max_new=5))
    plan = s.plan()
    with pytest.raises(KeyError, match="'a'"):
        s.absorb(plan, {})


def test_unschedulable_prompt():
    s = make(page_size=4, num_pages=3)  # 12 tokens of KV in all
    s.add(req("fits", range(11)))  # 11 + 1 tokens: 3 pages
    with pytest.raises(Unschedulable) as exc:
        s.add(req("long", range(12)))  # 12 + 1 tokens: 4 pages
    assert "12 tokens" in str(exc.value) and "4 KV pages" in str(exc.value) and "3 pages" in str(exc.value)
    assert isinstance(exc.value, ValueError)
    with pytest.raises(Unschedulable, match="empty"):
        s.add(req("empty", []))
    with pytest.raises(ValueError, match="already"):
        s.add(req("fits", [1]))
    assert s.rids() == ["fits"]
    assert s.abort("fits") is not None and s.check_idle() is None


def test_lone_request_longer_than_the_pool_ends_with_length():
    s = make(page_size=4, num_pages=3)
    s.add(req("a", range(5), max_new=100))
    done = drive(s, FakeWorker(4))
    f = done["a"]
    # 12 positions of KV: the prompt's 5 and 7 decodes, each sampling one more token.
    assert f.finish == FinishReason("length", length=8)
    assert f.request.output == reference(list(range(5)), 8)


def test_retraction_takes_the_newest_and_requeues_it_first():
    s = make(page_size=2, num_pages=4, max_running=3)  # 8 tokens of KV
    worker = FakeWorker(2)
    old, new = req("old", [1, 2, 3], max_new=5), req("new", [4, 5, 6], max_new=5)
    queued = req("q", [7, 7, 7], max_new=2)
    for r in (old, new, queued):
        s.add(r)
    for _ in range(2):  # old and new prefill, then decode at position 3: 2 pages each, the pool is full
        plan = s.plan()
        assert [q.request.rid for q in plan.seqs] == ["old", "new"]
        assert [r.rid for r in s.waiting] == ["q"]  # no page for its prompt: it stays first in line
        s.absorb(plan, worker.run(plan))
    plan = s.plan()  # old's position 4 needs a third page: new, admitted after it, gives its pages up
    assert [q.request.rid for q in plan.seqs] == ["old"]
    assert [r.rid for r in s.waiting] == ["new", "q"]  # ahead of the one admitted after it
    assert new.pages == [] and new.computed == 0 and len(new.output) == 2  # its output is kept
    assert len(old.pages) == 3
    s.absorb(plan, worker.run(plan))
    done = drive(s, worker)
    for r in (old, new, queued):
        assert done[r.rid].request.output == reference(r.prompt, r.finish.max_new_tokens)


def test_older_request_is_never_retracted_for_a_newer_one():
    retractions = 0
    for seed in range(30):
        rng = random.Random(seed)
        s = make(page_size=2, num_pages=rng.randint(10, 14), token_budget=rng.randint(4, 12), max_running=4)
        worker = FakeWorker(2)
        reqs = [req(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))], max_new=rng.randint(3, 12))
                for i in range(6)]
        for r in reqs:
            s.add(r)
        while True:
            before, waiting_before = s.running, s.waiting  # running in admission order
            plan = s.plan()
            if plan is None:
                break
            after = s.running
            gone = [i for i, r in enumerate(before) if r not in after and r in s.waiting]
            if gone:
                retractions += 1
                # Newest first: every request admitted after a retracted one was retracted too,
                # and nobody was admitted in exchange.
                assert gone == list(range(gone[0], len(before)))
                assert gone[0] > 0 or len(before) == 1  # the oldest keeps its place
                assert not any(r in after for r in waiting_before)
            s.absorb(plan, worker.run(plan))
        assert s.check_idle() is None
        for r in reqs:
            assert r.output == reference(r.prompt, r.finish.max_new_tokens)
    assert retractions > 10


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("next_token", [last_plus_position, context_hash])
@pytest.mark.parametrize("page_size, num_pages, budget, max_running", [
    (1, 12, 5, 4), (2, 8, 6, 3), (4, 5, 16, 5), (3, 5, 4, 3),
])
@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_gives_identical_outputs(next_token, page_size, num_pages, budget, max_running, cache, depth):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [3, 2], [3, 8, 4, 6]]
    max_new = [6, 9, 4, 8, 7]

    def outputs(pool):
        s = make(max_running=max_running, token_budget=budget, page_size=page_size, num_pages=pool, cache=cache)
        for i, (p, n) in enumerate(zip(prompts, max_new)):
            s.add(req(f"r{i}", p, max_new=n))
        plans: list[StepPlan] = []
        done = drive(s, FakeWorker(page_size, next_token), plans=plans, depth=depth)
        # a recompute: the first seq since a readmission of a request that already had output
        recomputes = sum(1 for p in plans for q in p.seqs
                         if (q.start == 0 or q.from_cache) and q.context_len > len(q.request.prompt))
        assert any(q.follows for p in plans for q in p.seqs) == (depth == 2)
        assert not any(p.ended for p in plans)
        assert all(f.finish.type == "length" for f in done.values())
        return {rid: f.request.output for rid, f in done.items()}, recomputes

    small, recomputes = outputs(num_pages)
    large, none = outputs(1000)
    assert recomputes > 0 and none == 0  # the small pool really preempted
    assert small == large
    for i, (p, n) in enumerate(zip(prompts, max_new)):
        assert small[f"r{i}"] == reference(p, n, next_token)


def test_overlap_a_plan_made_before_absorbing_feeds_the_token_in_flight_from_the_slot():
    s = make(token_budget=16)
    worker = FakeWorker(4)
    s.add(req("a", [1, 2, 3], max_new=4))
    first = s.plan()
    r1 = worker.run(first)
    s.add(req("b", [4, 5], max_new=2))
    second = s.plan()  # before first is absorbed: a feeds the token first samples, unseen
    a, b = second.seqs
    assert (a.request.rid, a.start, a.tokens, a.follows, a.sample) == ("a", 3, [core.FOLLOWS], True, True)
    assert (b.request.rid, b.follows, b.tokens) == ("b", False, [4, 5]) and a.request.slot != b.request.slot
    r2 = worker.run(second)
    s.absorb(first, r1)
    third = s.plan()  # the tokens second samples are in flight: both follow
    assert [(q.request.rid, q.follows) for q in third.seqs] == [("a", True), ("b", True)]
    r3 = worker.run(third)
    s.absorb(second, r2)
    fourth = s.plan()  # b's last allowed token (max_new 2) is in flight: it does not follow
    assert [(q.request.rid, q.follows) for q in fourth.seqs] == [("a", True)]
    r4 = worker.run(fourth)
    assert [f.request.rid for f in s.absorb(third, r3)] == ["b"]
    assert [f.request.rid for f in s.absorb(fourth, r4)] == ["a"]  # four tokens, from four steps
    assert a.request.output == reference([1, 2, 3], 4) and b.request.output == reference([4, 5], 2)
    assert s.plan() is None and s.check_idle() is None


def test_overlap_a_request_ending_on_the_token_in_flight_drops_the_step_that_followed():
    ref = reference([1, 2, 3], 6)
    s = make(page_size=2, num_pages=8)
    worker = FakeWorker(2)
    s.add(req("a", [1, 2, 3], max_new=6, stop=(ref[1],)))
    plans = [s.plan()]
    results = [worker.run(plans[0])]
    while plans:
        plan = s.plan()  # one step ahead of the absorbed ones
        if plan is not None:
            plans.append(plan)
            results.append(worker.run(plan))
        finished = s.absorb(plans.pop(0), results.pop(0))
        check_state(s)
        if finished:
            break
    assert finished[0].request.output == ref[:2] and finished[0].finish.type == "stop"
    assert len(plans) == 1 and plans[0].seqs[0].follows  # computed a third token for nothing
    assert s.absorb(plans[0], results[0]) == [] and finished[0].request.output == ref[:2]
    assert s.check_idle() is None and s.allocator.num_used == 0


def test_request_retracted_while_its_token_is_in_flight_waits_for_it():
    s = make(page_size=2, num_pages=3)
    worker = FakeWorker(2)
    s.add(req("old", [1, 2], max_new=5))
    plan1 = s.plan()
    r1 = worker.run(plan1)
    s.add(req("new", [4, 5], max_new=3))
    plan2 = s.plan()  # old follows on its second page; new takes the last page and samples
    r2 = worker.run(plan2)
    s.absorb(plan1, r1)
    plan3 = s.plan()  # both would follow; new needs a page: it is retracted with its first token in flight
    r3 = worker.run(plan3)
    new = plan2.seqs[1].request
    assert [q.request.rid for q in plan3.seqs] == ["old"] and s.waiting == [new] and new.awaiting == 1
    s.abort("old")
    # The pool is free, but recomputing new now would sample the position whose token is in flight.
    assert s.plan() is None
    s.absorb(plan2, r2)
    assert s.absorb(plan3, r3) == []
    done = drive(s, worker)
    assert done["new"].request.output == reference([4, 5], 3)


def test_plan_is_none_when_idle_and_check_idle_reports_leaks():
    s = make()
    assert s.plan() is None and s.check_idle() is None
    s.allocator.allocate(2)  # pages nobody owns: a leak
    assert "2 of 256" in s.check_idle()


def prompts_sharing_prefixes(rng: random.Random, count: int, longest: int = 12) -> list[list[int]]:
    """Prompts of 1..longest tokens, most of them a few common beginnings plus their own ends, some
    repeated whole, some another prompt's prompt + reference output (a conversation's next turn)."""
    bases = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, longest - 1))] for _ in range(rng.randint(1, 3))]
    prompts: list[list[int]] = []
    for _ in range(count):
        roll = rng.random()
        if prompts and roll < 0.2:
            prompt = list(rng.choice(prompts))
        elif prompts and roll < 0.3:
            before = rng.choice(prompts)
            prompt = (before + reference(before, longest))[: rng.randint(len(before), longest)]
        elif roll < 0.85:
            base = rng.choice(bases)
            prompt = base + [rng.randrange(VOCAB) for _ in range(rng.randint(0, longest - len(base)))]
        else:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, longest))]
        prompts.append(prompt)
    return prompts


@pytest.mark.parametrize("cache, policy, speculative", [(False, "fcfs", False), (True, "fcfs", False), (True, "lpm", False),
                                                    (False, "fcfs", True), (True, "lpm", True)])
def test_randomized_workloads_keep_invariants_and_outputs(cache, policy, speculative):
    hits = accepted = 0
    next_token = mostly_copying if speculative else context_hash
    for seed in range(60):
        rng = random.Random(seed)
        page_size = rng.choice([1, 2, 3, 4, 8])
        max_running = rng.randint(1, 6)
        budget = rng.randint(max_running, 24)
        num_pages = rng.randint(math.ceil(13 / page_size), 40)
        drafter = NgramDrafter(rng.randint(1, 6), rng.randint(1, 2), 3) if speculative else None
        s = make(max_running=max_running, token_budget=budget, page_size=page_size, num_pages=num_pages,
                 cache=cache, policy=policy, drafter=drafter)
        worker = FakeWorker(page_size, next_token)
        pending_adds: list[Request] = []
        count = rng.randint(1, 12)
        prompts = prompts_sharing_prefixes(rng, count) if cache else [
            [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(count)]
        for i, prompt in enumerate(prompts):
            max_new = rng.randint(1, 30 if speculative else 15)
            ref = reference(prompt, max_new, next_token)
            stop = (rng.choice(ref),) if rng.random() < 0.4 else ()
            score_from = rng.choice([-1, 0, rng.randrange(len(prompt))])
            min_new = rng.randint(0, max_new) if stop else 0
            if i % 5 == 4:  # prefill-only: asks for no token (scores its prompt, or only fills the cache)
                max_new, stop, min_new = 0, (), 0
            pending_adds.append(req(f"r{i}", prompt, max_new=max_new, stop=stop, min_new=min_new, score_from=score_from))
        everyone = list(pending_adds)
        depth = rng.choice([1, 1, 2, 3])  # steps in flight before the oldest is absorbed
        in_flight: list[tuple[StepPlan, dict]] = []
        ended: dict[str, str] = {}
        for _ in range(3000):
            while pending_adds and rng.random() < 0.5:
                s.add(pending_adds.pop(0))
            if rng.random() < 0.05 and s.rids():  # abort or stop-string finish, maybe mid-step
                rid = rng.choice(s.rids())
                assert getattr(s, rng.choice(["abort", "finish"]))(rid).rid == rid
                ended[rid] = "abort"
            if cache and rng.random() < 0.01:  # the worker restarted (this fake one keeps its cache)
                s.invalidate_cache()
            if cache and not s.rids() and rng.random() < 0.1:
                s.flush_cache()
            plan = s.plan()
            if plan is not None:
                check_plan(s, plan)
                for f in plan.ended:
                    ended[f.request.rid] = "pool"
                in_flight.append((plan, worker.run(plan)))
            check_state(s)
            if in_flight and (len(in_flight) >= depth or plan is None):
                old, results = in_flight.pop(0)
                for f in s.absorb(old, results):
                    ended[f.request.rid] = f.finish.type
                check_state(s)
            if not pending_adds and not in_flight and not s.rids():
                break
        else:
            raise AssertionError(f"seed {seed}: no progress")
        assert s.check_idle() is None, seed
        hits += s.stats()["prefix_cache_hits_total"]
        accepted += s.stats()["spec_decode_num_accepted_tokens_total"]
        s.flush_cache()
        assert s.stats()["pages_free"] == num_pages
        assert sorted(ended) == sorted(r.rid for r in everyone)
        for r in everyone:  # finished, aborted or cut by the pool: always a prefix of the reference
            assert r.output == reference(r.prompt, r.finish.max_new_tokens, next_token)[: len(r.output)], seed
            assert r.pages == []
            # Prompt positions scored in order, each once (FakeWorker checks), all of them once sampled
            # (or, asking for no token, once finished by its prompt: length 0).
            scored = worker.scored.get(r.rid, [])
            wanted = list(range(r.prompt_logprobs_from, len(r.prompt))) if r.prompt_logprobs_from >= 0 else []
            prefilled = r.finish.max_new_tokens == 0 and ended[r.rid] == "length"
            assert scored == (wanted if r.output or prefilled else wanted[: len(scored)]), seed
            assert r.finish.max_new_tokens > 0 or r.output == [], seed
    assert (hits > 100) == cache, hits
    assert (accepted > 100) == speculative, accepted


def test_randomized_outputs_match_reference():
    for seed in range(40):
        rng = random.Random(1000 + seed)
        page_size = rng.choice([1, 2, 4])
        s = make(max_running=rng.randint(1, 5), token_budget=rng.randint(5, 20), page_size=page_size,
                 num_pages=rng.randint(math.ceil(16 / page_size), 30))
        reqs = []
        for i in range(rng.randint(1, 8)):
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 15))]
            max_new = rng.randint(1, 12)
            ref = reference(prompt, max_new)
            stop = (ref[rng.randrange(max_new)],) if rng.random() < 0.5 else ()
            r = req(f"r{i}", prompt, max_new=max_new, stop=stop, min_new=rng.randint(0, 3))
            reqs.append(r)
            s.add(r)
        done = drive(s, FakeWorker(page_size))
        assert sorted(done) == sorted(r.rid for r in reqs)
        for r in reqs:
            f = done[r.rid]
            full = reference(r.prompt, r.finish.max_new_tokens)
            assert r.output == full[: len(r.output)], seed
            if f.finish.type == "stop":
                assert r.output[-1] in r.finish.stop_token_ids and len(r.output) >= r.finish.min_new_tokens
            else:
                assert f.finish == FinishReason("length", length=len(r.output))
            # no earlier token could have stopped it
            for k, t in enumerate(r.output[:-1], start=1):
                assert not (t in r.finish.stop_token_ids and k >= r.finish.min_new_tokens)


# --- prompt logprobs: score_from and next_token ---------------------------------------------


def seq_scores(plan: StepPlan) -> list[tuple[int, int, int, int]]:
    return [(q.start, q.context_len, q.score_from, q.next_token) for q in plan.seqs]


@pytest.mark.parametrize("score_from, expected", [
    # (start, context_len, score_from, next_token) of each step: 3 chunks of the 25-token prompt, a decode
    (0, [(0, 10, 0, 110), (10, 20, 11, 120), (20, 25, 21, -1), (25, 26, -1, -1)]),
    (15, [(0, 10, -1, 110), (10, 20, 15, 120), (20, 25, 21, -1), (25, 26, -1, -1)]),
    (10, [(0, 10, 10, 110), (10, 20, 11, 120), (20, 25, 21, -1), (25, 26, -1, -1)]),
    (24, [(0, 10, -1, 110), (10, 20, -1, 120), (20, 25, 24, -1), (25, 26, -1, -1)]),
    (-1, [(0, 10, -1, 110), (10, 20, -1, 120), (20, 25, -1, -1), (25, 26, -1, -1)]),
])
def test_score_from_and_next_token_across_chunk_boundaries(score_from, expected):
    s = make(token_budget=10)
    prompt = list(range(100, 125))
    s.add(req("a", prompt, max_new=2, score_from=score_from))
    worker = FakeWorker(4)
    steps = []
    for _ in range(4):
        plan = s.plan()
        steps += seq_scores(plan)
        s.absorb(plan, worker.run(plan))
    assert steps == expected
    assert worker.scored.get("a", []) == list(range(max(score_from, 0), 25)) * (score_from >= 0)


def test_one_token_prompt_scores_position_zero_alone():
    s = make()
    s.add(req("a", [7], max_new=2, score_from=0))
    worker = FakeWorker(4)
    plan = s.plan()
    assert seq_scores(plan) == [(0, 1, 0, -1)]
    s.absorb(plan, worker.run(plan))
    assert worker.scored["a"] == [0]
    assert seq_scores(s.plan()) == [(1, 2, -1, -1)]


# --- prefill-only requests (max_new_tokens 0): score the prompt, sample nothing ---------------


@pytest.mark.parametrize("depth", [1, 2])  # 2: the scheduler service's overlap
def test_a_prefill_only_request_scores_its_prompt_in_chunks_and_samples_nothing(depth):
    s = make(token_budget=10, page_size=4)
    prompt = list(range(100, 125))  # 25 tokens: 3 chunks
    r = req("a", prompt, max_new=0, score_from=0)
    s.add(r)
    worker = FakeWorker(4)
    plans: list[StepPlan] = []
    done = drive(s, worker, plans=plans, depth=depth)
    assert [(q.start, q.context_len, q.sample, q.ends) for p in plans for q in p.seqs] == [
        (0, 10, False, False), (10, 20, False, False), (20, 25, False, True)]  # no decode after
    assert done["a"].finish == FinishReason("length", length=0) and r.output == [] and r.logprobs == []
    assert worker.scored["a"] == list(range(25)) and worker.slots == {}  # every position once; nothing sampled
    stats = s.stats()
    assert stats["generation_tokens_total"] == 0 and stats["prompt_tokens_total"] == 25


@pytest.mark.parametrize("score_from, start", [(0, 0), (6, 4), (13, 12), (-1, 12)])
def test_a_prefill_only_request_takes_the_cached_prefix_up_to_its_first_scored_position(score_from, start):
    s = make(page_size=4, token_budget=4, cache=True)
    worker = FakeWorker(4)
    prompt = list(range(50, 64))  # 14 tokens
    run_one(s, worker, req("a", prompt, max_new=1))  # its 3 whole pages go to the cache
    plans: list[StepPlan] = []
    b = req("b", prompt, max_new=0, score_from=score_from)
    finished = run_one(s, worker, b, plans)
    assert finished.finish == FinishReason("length", length=0) and b.output == []
    assert plans[0].seqs[0].start == start == b.cached_tokens
    assert plans[-1].seqs[0].ends and not any(q.sample for p in plans for q in p.seqs)
    assert worker.scored.get("b", []) == (list(range(score_from, 14)) if score_from >= 0 else [])
    assert s.stats()["generation_tokens_total"] == 1  # a's one token only


def test_a_prefill_only_request_may_fill_the_whole_pool():
    s = make(page_size=4, num_pages=2)
    r = req("a", range(8), max_new=0, score_from=0)  # 8 tokens, 2 pages: no page for a decode, none needed
    assert run_one(s, FakeWorker(4), r).finish == FinishReason("length", length=0)
    with pytest.raises(Unschedulable, match=r"\(prompt \+ 1\)"):
        s.add(req("b", range(8), max_new=1))


def test_a_prefill_only_request_retracted_while_its_end_is_in_flight_is_not_fed_again():
    s = make(page_size=2, token_budget=16)
    worker = FakeWorker(2)
    r = req("a", range(6), max_new=0, score_from=0)
    s.add(r)
    plan = s.plan()
    (q,) = plan.seqs
    assert q.ends and r.awaiting == 1
    results = worker.run(plan)
    assert s.retract_all() == 1
    assert s.plan() is None  # its end is in flight: recomputing would score nothing and end it twice
    (finished,) = s.absorb(plan, results)
    assert finished.request is r and finished.finish == FinishReason("length", length=0)
    assert s.rids() == [] and s.check_idle() is None


def test_recompute_after_retraction_never_scores_a_position_twice():
    # 6 pages of 2 tokens: "old" outgrows its pages while "new" is mid-prompt, so "new" is retracted
    # after some of its prompt was scored, then recomputed from position 0.
    s = make(page_size=2, num_pages=6, token_budget=4, max_running=2)
    old = req("old", [1, 2, 3], max_new=9)
    new = req("new", list(range(200, 208)), max_new=3, score_from=0)
    s.add(old)
    s.add(new)
    worker = FakeWorker(2)
    plans: list[StepPlan] = []
    drive(s, worker, plans=plans)
    news = [q for p in plans for q in p.seqs if q.request is new]
    restarts = [i for i, q in enumerate(news) if q.start == 0]
    assert len(restarts) >= 2, "new was never retracted"
    refed = news[restarts[1]]  # the recompute's first chunk re-feeds positions already scored
    assert refed.score_from == -1 and refed.next_token == new.prompt[refed.context_len]
    assert worker.scored["new"] == list(range(8))
    assert new.output == reference(new.prompt, 3)


@pytest.mark.parametrize("page_size, num_pages, budget, max_running", [
    (1, 12, 5, 4), (2, 8, 6, 3), (4, 5, 16, 5), (3, 5, 4, 3),
])
def test_prompt_scores_under_preemption_are_complete_and_never_repeated(page_size, num_pages, budget, max_running):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [3, 2], [3, 8, 4, 6]]
    froms = [0, 1, 4, -1, 2]
    s = make(max_running=max_running, token_budget=budget, page_size=page_size, num_pages=num_pages)
    for i, (p, f) in enumerate(zip(prompts, froms)):
        s.add(req(f"r{i}", p, max_new=7, score_from=f))
    worker = FakeWorker(page_size)
    plans: list[StepPlan] = []
    drive(s, worker, plans=plans)
    assert s.stats()["preempted_total"] > 0
    for i, (p, f) in enumerate(zip(prompts, froms)):
        assert worker.scored.get(f"r{i}", []) == (list(range(f, len(p))) if f >= 0 else [])


# --- abort, queue limit, stats ---------------------------------------------------------------


def test_prefilled_is_set_once_a_step_feeds_the_request_and_survives_retraction():
    s = make(max_running=1, token_budget=4)
    a, b = req("a", range(10), max_new=2), req("b", [1, 2], max_new=2)
    s.add(a)
    s.add(b)
    assert not a.prefilled and not b.prefilled
    plan = s.plan()  # a's first chunk
    assert a.prefilled and not b.prefilled
    s.absorb(plan, FakeWorker(4).run(plan))
    assert s.abort("b").prefilled is False  # never fed: an abort "before prefill"
    assert s.abort("a").prefilled is True


def test_queue_limit_refuses_beyond_max_queued():
    s = make(max_running=1, max_queued=2)
    for rid in ("a", "b"):
        s.add(req(rid, [1, 2]))
    with pytest.raises(QueueFull, match="max_queued_requests.*2"):
        s.add(req("c", [1, 2]))
    assert not isinstance(QueueFull("x"), ValueError)  # not a 400
    s.plan()  # admits a: one waits
    s.add(req("c", [1, 2]))
    with pytest.raises(QueueFull):
        s.add(req("d", [1, 2]))
    with pytest.raises(Unschedulable):  # what can never run is refused as such, full queue or not
        s.add(req("e", []))
    assert sorted(s.rids()) == ["a", "b", "c"] and s.stats()["requests_total"] == 3
    with pytest.raises(ValueError, match="max_queued"):
        make(max_queued=0)


def test_stats_counters():
    s = make(page_size=2, num_pages=8, token_budget=4, max_running=2, max_queued=10)
    s.add(req("a", range(5), max_new=8))  # 13 tokens: 7 of the 8 pages, so b is preempted
    s.add(req("b", range(20, 23), max_new=20))
    s.add(req("c", [1], max_new=3))
    worker = FakeWorker(2)
    for _ in range(3):
        plan = s.plan()
        s.absorb(plan, worker.run(plan))
    s.abort("c")  # still waiting: counted as aborted, no prompt token
    st = s.stats()
    assert (st["requests_total"], st["aborted_total"], st["max_queued_requests"]) == (3, 1, 10)
    assert (st["max_running_requests"], st["max_total_tokens"]) == (2, 16)
    done = drive(s, worker)
    st = s.stats()
    outputs = sum(len(f.request.output) for f in done.values())
    assert st["generation_tokens_total"] == outputs == 8 + len(done["b"].request.output)
    assert st["prompt_tokens_total"] == 5 + 3  # a's and b's prompts, a recompute not counted again
    assert st["preempted_total"] > 0 and st["aborted_total"] == 1  # a stop-string finish is no abort
    s.add(req("d", [1, 2], max_new=5))
    s.finish("d")
    assert s.stats()["aborted_total"] == 1
    assert "max_queued_requests" not in make().stats()


def slots_of(s: Scheduler) -> tuple[int, int, int]:
    st = s.stats()
    return st["state_slots_total"], st["state_slots_used"], st["state_slots_free"]


def test_a_hybrids_state_slots_are_the_running_requests_slots():
    """A hybrid's recurrent state lives in its request slot's row (worker_svc/slots.py): a request
    holds one from admission to its finish, abort or retraction, and the stats say so."""
    s = make(page_size=2, num_pages=4, max_running=3, state_slots=True)  # 8 tokens of KV: the third request waits
    worker = FakeWorker(2)
    assert slots_of(s) == (3, 0, 3)
    old, new, queued = req("old", [1, 2, 3], max_new=5), req("new", [4, 5, 6], max_new=5), req("q", [7, 7, 7], max_new=2)
    for r in (old, new, queued):
        s.add(r)
    for _ in range(2):
        plan = s.plan()
        s.absorb(plan, worker.run(plan))
    assert slots_of(s) == (3, 2, 1)  # q waits for pages, holding no slot
    plan = s.plan()  # old needs a third page: new is retracted, its slot freed with its pages
    assert new.slot == -1 and slots_of(s) == (3, 1, 2)
    s.absorb(plan, worker.run(plan))
    s.abort("old")
    drive(s, worker)
    assert slots_of(s) == (3, 0, 3)
    assert "state_slots_total" not in make().stats()  # a model without linear layers has no such pool


# --- the prefix cache -------------------------------------------------------------------------


def run_one(s: Scheduler, worker: FakeWorker, r: Request, plans: list | None = None) -> Finished:
    s.add(r)
    return drive(s, worker, plans=plans)[r.rid]


def test_a_shared_prefix_is_read_from_the_cache_not_recomputed():
    s = make(page_size=4, cache=True)
    worker = FakeWorker(4)
    base = list(range(100, 110))  # 10 tokens: two whole pages
    run_one(s, worker, req("a", base + [1, 2], max_new=3))
    plans: list[StepPlan] = []
    b = req("b", base + [7, 8, 9], max_new=5)
    done = run_one(s, worker, b, plans)
    first = plans[0].seqs[0]
    assert (first.start, first.tokens, first.first, first.from_cache) == (8, base[8:] + [7, 8, 9], True, True)
    assert b.cached_tokens == 8 and done.request.output == reference(b.prompt, 5)
    st = s.stats()
    assert (st["prefix_cache_queries_total"], st["prefix_cache_hits_total"]) == (12 + 13, 8)
    assert st["prompt_tokens_total"] == 12 + 5  # the cached 8 were not computed again
    # a's prompt + output was cached too (whole pages): a follow-up turn reuses it
    a_turn = base + [1, 2] + reference(base + [1, 2], 3) + [5, 5]
    c = req("c", a_turn, max_new=2)
    run_one(s, worker, c)
    assert c.cached_tokens == 12 and c.output == reference(a_turn, 2)


def test_a_prompt_wholly_cached_still_feeds_its_last_token():
    s = make(page_size=4, cache=True)
    worker = FakeWorker(4)
    prompt = list(range(8))  # exactly two pages
    run_one(s, worker, req("a", prompt, max_new=2))
    plans: list[StepPlan] = []
    b = req("b", prompt, max_new=2)
    run_one(s, worker, b, plans)
    assert b.cached_tokens == 4  # not 8: the step feeding position 7 samples, so page 1 is recomputed
    assert (plans[0].seqs[0].start, plans[0].seqs[0].tokens) == (4, prompt[4:])
    assert b.output == reference(prompt, 2)
    one = req("one", [0], max_new=1)  # a one-token prompt has nothing to take
    run_one(s, worker, one)
    assert one.cached_tokens == 0


@pytest.mark.parametrize("score_from, start", [(0, 0), (1, 0), (2, 0), (5, 4), (6, 4), (9, 8), (13, 12), (-1, 12)])
def test_a_cache_hit_stops_before_the_first_position_to_score(score_from, start):
    # Position q is scored by the logits at q - 1: feeding starts at or before q - 1 (page-aligned).
    s = make(page_size=4, cache=True)
    worker = FakeWorker(4)
    prompt = list(range(50, 64))  # 14 tokens
    run_one(s, worker, req("a", prompt, max_new=1))
    plans: list[StepPlan] = []
    b = req("b", prompt, max_new=2, score_from=score_from)
    run_one(s, worker, b, plans)
    assert plans[0].seqs[0].start == start == b.cached_tokens
    assert worker.scored.get("b", []) == (list(range(score_from, 14)) if score_from >= 0 else [])
    assert b.output == reference(prompt, 2)


def test_running_requests_pin_what_they_read_and_are_never_evicted_from_under():
    s = make(page_size=2, num_pages=20, token_budget=64, cache=True)
    worker = FakeWorker(2)
    base = [1, 2, 3, 4, 5, 6]
    run_one(s, worker, req("a", base + [9, 9, 9], max_new=1))  # 9 tokens computed: 4 whole pages cached
    assert s.stats()["pages_cached"] == 4 and s.stats()["pages_evictable"] == 4
    b = req("b", base + [7], max_new=20)
    s.add(b)
    plan = s.plan()
    s.absorb(plan, worker.run(plan))
    assert b.shared == 3 and all(n.refs == 1 for n in b.node.path())
    assert s.stats()["pages_evictable"] == 1
    assert s.cache.evict(100) == 1  # only a's last page: b pins the rest
    done = drive(s, worker)
    assert done["b"].request.output == reference(b.prompt, 20)


def test_unpinned_cache_pages_are_evicted_before_any_request_is_retracted():
    s = make(page_size=2, num_pages=10, token_budget=8, max_running=4, cache=True)
    worker = FakeWorker(2)
    for i in range(3):  # fill the cache with others' pages: 3 x 3 pages
        run_one(s, worker, req(f"old{i}", [10 * i + k for k in range(6)], max_new=1))
    assert s.stats()["pages_cached"] == 9
    x, y = req("x", [7, 7, 7], max_new=6), req("y", [8, 8, 8], max_new=6)
    s.add(x)
    s.add(y)
    done = drive(s, worker)
    assert s.stats()["preempted_total"] == 0  # the cache gave its pages up instead
    assert done["x"].request.output == reference(x.prompt, 6) and done["y"].request.output == reference(y.prompt, 6)


def test_a_retracted_request_reuses_its_own_cached_prefix():
    s = make(page_size=2, num_pages=7, token_budget=16, max_running=2, cache=True)
    worker = FakeWorker(2)
    old, new = req("old", [1, 2, 3], max_new=9), req("new", list(range(20, 27)), max_new=4)
    s.add(old)
    s.add(new)
    plans: list[StepPlan] = []
    done = drive(s, worker, plans=plans)
    assert s.stats()["preempted_total"] >= 1
    news = [q for p in plans for q in p.seqs if q.request is new]
    readmitted = [q for q in news[1:] if q.from_cache]
    assert readmitted and readmitted[0].start > 0  # not from position 0: its pages were in the cache
    assert new.cached_tokens == 0  # it took nothing at its first admission
    assert done["new"].request.output == reference(new.prompt, 4)
    assert done["old"].request.output == reference(old.prompt, 9)


def test_concurrent_identical_prompts_end_up_sharing_pages():
    s = make(page_size=2, token_budget=64, cache=True)
    worker = FakeWorker(2)
    prompt = list(range(30, 41))  # 11 tokens: 5 whole pages
    a, b = req("a", prompt, max_new=8), req("b", prompt, max_new=8)
    s.add(a)
    s.add(b)  # admitted in the same step: neither can read the other's pages yet
    plan = s.plan()
    assert [q.start for q in plan.seqs] == [0, 0]
    s.absorb(plan, worker.run(plan))
    plan = s.plan()  # a's pages went to the cache; b's copies were swapped for them and freed
    assert a.pages[:5] == b.pages[:5] and a.shared == b.shared == 5
    assert s.stats()["pages_used"] == 5 + 2  # the shared five, and each one's own last page
    s.absorb(plan, worker.run(plan))
    done = drive(s, worker)
    assert done["a"].request.output == done["b"].request.output == reference(prompt, 8)


def test_lpm_admits_the_longest_cached_prefix_first_and_fcfs_keeps_queue_order():
    order = {}
    for policy in ("fcfs", "lpm"):
        s = make(page_size=2, max_running=1, cache=True, policy=policy)
        worker = FakeWorker(2)
        run_one(s, worker, req("warm", list(range(10)), max_new=1))
        for rid, prompt in (("cold", [99, 98, 97]), ("some", [0, 1, 2, 3, 50]), ("most", list(range(9)))):
            s.add(req(rid, prompt, max_new=2))
        plans: list[StepPlan] = []
        drive(s, worker, plans=plans)
        order[policy] = list(dict.fromkeys(q.request.rid for p in plans for q in p.seqs))
    assert order == {"fcfs": ["cold", "some", "most"], "lpm": ["most", "some", "cold"]}


def test_lpm_admits_a_head_overtaken_too_often(monkeypatch):
    monkeypatch.setattr(core, "LPM_WINDOW", 2)
    s = make(page_size=2, max_running=1, cache=True, policy="lpm")
    worker = FakeWorker(2)
    hot = list(range(10))
    run_one(s, worker, req("warm", hot, max_new=1))
    s.add(req("cold", [99, 98, 97], max_new=1))
    for i in range(4):
        s.add(req(f"hot{i}", hot[:8] + [i], max_new=1))
    plans: list[StepPlan] = []
    drive(s, worker, plans=plans)
    order = list(dict.fromkeys(q.request.rid for p in plans for q in p.seqs))
    assert order == ["hot0", "hot1", "cold", "hot2", "hot3"]  # overtaken twice, then its turn


def test_flush_cache_only_at_idle_and_then_every_page_is_free():
    s = make(page_size=2, cache=True)
    worker = FakeWorker(2)
    run_one(s, worker, req("a", list(range(9)), max_new=3))
    cached = s.stats()["pages_cached"]
    assert cached == 5 and s.allocator.num_used == 5 and s.check_idle() is None
    s.add(req("b", [1, 2], max_new=3))
    with pytest.raises(Busy, match="0 requests running and 1 waiting"):
        s.flush_cache()
    plan = s.plan()
    results = worker.run(plan)  # the worker got the step
    with pytest.raises(Busy, match="1 request running"):
        s.flush_cache()
    s.abort("b")  # its step in flight: the cache may still be emptied (the worker runs steps in order)
    assert s.flush_cache() == cached + 1 and s.allocator.num_used == 0  # b's page was cached at its end
    s.absorb(plan, results)
    b = req("again", list(range(9)), max_new=3)
    run_one(s, worker, b)
    assert b.cached_tokens == 0 and b.output == reference(list(range(9)), 3)
    assert make().flush_cache() == 0  # no cache: nothing to flush


def test_check_idle_reports_pages_outside_the_cache_or_pinned():
    s = make(page_size=2, cache=True)
    run_one(s, FakeWorker(2), req("a", list(range(5)), max_new=1))
    assert s.check_idle() is None
    s.allocator.allocate(1)
    assert "1 of 256 KV pages are allocated outside the prefix cache" in s.check_idle()
    s2 = make(page_size=2, cache=True)
    run_one(s2, FakeWorker(2), req("a", list(range(5)), max_new=1))
    s2.cache.pin(s2.cache.match(list(range(4)))[0])
    assert "2 prefix cache pages are pinned" in s2.check_idle()


def test_after_the_worker_is_lost_nothing_computed_before_is_reused():
    s = make(page_size=2, cache=True)
    worker = FakeWorker(2)
    prompt = list(range(10))
    run_one(s, worker, req("a", prompt, max_new=1))
    b = req("b", prompt, max_new=6)
    s.add(b)
    plan = s.plan()
    s.absorb(plan, worker.run(plan))
    assert b.shared == 4
    s.invalidate_cache()  # a new worker: every page's KV is gone
    assert s.stats()["pages_cached"] == 4  # b's pinned path, freed when b ends; nothing else
    done = drive(s, worker)
    assert done["b"].request.output == reference(prompt, 6)
    assert s.stats()["pages_used"] == 0 and s.check_idle() is None  # nothing b computed was cached
    c = req("c", prompt, max_new=1)
    run_one(s, worker, c)
    assert c.cached_tokens == 0


def test_without_a_cache_nothing_changes():
    s = make(page_size=2)
    worker = FakeWorker(2)
    run_one(s, worker, req("a", list(range(10)), max_new=2))
    b = req("b", list(range(10)), max_new=2)
    run_one(s, worker, b)
    st = s.stats()
    assert b.cached_tokens == 0 and st["pages_used"] == st["pages_cached"] == st["prefix_cache_hits_total"] == 0
    with pytest.raises(ValueError, match="policy"):
        make(policy="sjf")


# -- speculative decoding (core.py 8.)


def copying(context: list[int]) -> int:
    """Next token: the one 4 positions back (a model repeating a passage)."""
    return context[-4] if len(context) >= 4 else (context[-1] + 1) % VOCAB


@pytest.mark.parametrize("depth", [1, 2])
def test_ngram_drafts_verify_many_tokens_per_step_with_the_same_output(depth):
    outputs, steps = {}, {}
    for drafter in (None, NgramDrafter(4, 2, 3)):
        s = make(max_running=5, token_budget=16, page_size=4, drafter=drafter)
        s.add(req("a", [5, 6, 7, 8, 5, 6], max_new=40))
        plans: list[StepPlan] = []
        done = drive(s, FakeWorker(4, copying), plans=plans, depth=depth)
        outputs[drafter is None], steps[drafter is None] = done["a"].request.output, len(plans)
    assert outputs[True] == outputs[False] == reference([5, 6, 7, 8, 5, 6], 40, copying)
    stats = s.stats()
    # Every draft is right: 4 tokens a draft (5 rows with its decode's), 5 tokens a step
    assert stats["spec_decode_num_accepted_tokens_total"] == stats["spec_decode_num_draft_tokens_total"] == 4 * 7 + 3
    assert stats["spec_decode_acceptance_rate"] == 1.0
    assert steps == {True: 40, False: 9}, steps  # the prefill's token, then 39 in 8 steps (the last drafts 3)


def test_a_draft_in_flight_is_not_followed_and_its_rejection_frees_pages():
    s = make(max_running=8, token_budget=16, page_size=2, drafter=NgramDrafter(4, 1, 1))
    s.add(req("a", [1, 2, 3, 1], max_new=20))
    worker = FakeWorker(2, lambda ctx: 7)
    s.absorb(plan := s.plan(), worker.run(plan))  # samples 7
    plan = s.plan()  # [7] never occurred
    s.absorb(plan, worker.run(plan))  # samples 7: now [7] follows [7]
    plan = s.plan()
    assert plan.seqs[0].drafts == 4
    assert s.plan() is None, "a request with a draft in flight is planned again"
    r = plan.seqs[0].request
    assert len(r.pages) == 5 and r.drafted == 4  # positions 5 .. 9
    s.absorb(plan, {"a": [(7, -0.1), (7, -0.1), (8, -0.2)]})  # two accepted, then 8
    assert r.output == [7, 7, 7, 7, 8] and r.computed == 8 and len(r.pages) == 4 and s.allocator.num_used == 4
    assert s.stats()["spec_decode_acceptance_rate"] == 0.5
    plan = s.plan()  # [8] never occurred: no draft
    assert plan.seqs[0].drafts == 0
    with pytest.raises(ValueError, match="do not verify"):  # a worker that returns more than it may
        s.absorb(plan, {"a": [(8, 0.0), (9, 0.0)]})


def test_a_decode_that_would_draft_waits_for_its_token_in_flight():
    s = make(max_running=4, token_budget=16, page_size=4, drafter=NgramDrafter(4, 2, 2))
    s.add(req("a", [1, 2, 1, 2], max_new=20))
    s.add(req("b", [50, 60, 70], max_new=20))
    assert [q.request.rid for q in s.plan().seqs] == ["a", "b"]  # both prefill
    second = s.plan()  # overlap: b follows its token in flight; a's suffix [1, 2] occurred: it waits
    assert [q.request.rid for q in second.seqs] == ["b"] and second.seqs[0].follows


def test_a_decode_without_room_for_a_draft_follows():
    s = make(max_running=3, token_budget=16, page_size=4, drafter=NgramDrafter(4, 2, 2))
    s.add(req("a", [1, 2, 1, 2], max_new=20))
    s.add(req("b", [50, 60, 70], max_new=20))
    s.add(req("c", [80, 90], max_new=20))
    s.add(req("d", [85, 95], max_new=20))  # waiting: the step's spare sampled rows are for a, b, c and it
    s.plan()
    assert [(q.request.rid, q.follows) for q in s.plan().seqs] == [("a", True), ("b", True), ("c", True)]


@pytest.mark.parametrize("sampling, min_new", [(SamplingParams(max_new_tokens=20, constraint=Constraint("regex", "a+")), 0),
                                               (SamplingParams(max_new_tokens=20), 30)])
def test_no_draft_for_constraints_or_below_min_tokens(sampling, min_new):
    s = make(max_running=2, token_budget=16, page_size=4, drafter=NgramDrafter(4, 1, 2))
    s.add(Request(rid="a", gateway="g", prompt=[1, 1, 1, 1], sampling=sampling, finish=FinishRule((), 20, min_new)))
    drive(s, FakeWorker(4, lambda ctx: 1), plans=(plans := []))
    assert not any(q.drafts for p in plans for q in p.seqs) and len(plans) == 20


def test_drafts_stay_within_max_new_tokens_the_budget_and_the_sampled_rows():
    s = make(max_running=3, token_budget=9, page_size=4, drafter=NgramDrafter(8, 1, 2))
    for rid in "ab":
        s.add(req(rid, [1, 1, 1], max_new=7))
    plans: list[StepPlan] = []
    done = drive(s, FakeWorker(4, lambda ctx: 1), plans=plans)  # check_plan: rows <= 3, tokens <= 9
    assert all(f.request.output == [1] * 7 for f in done.values())
    drafted = [q.drafts for p in plans for q in p.seqs if q.drafts]
    assert drafted and max(drafted) == 2  # 3 rows: a, b and one draft token, or a alone and two
