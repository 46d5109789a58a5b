"""A hybrid model's state snapshots in the scheduler (scheduler_svc/snapshots.py): hits cut back to
a snapshot, chunks aligned to the boundary whose state is kept, rows evicted, flushed, invalidated,
and never read and overwritten in one step.

The fake worker keeps a recurrent "state" per slot and per snapshot row, as the real one keeps the
linear layers' (a hash of every token fed before, from position 0 on): a seq resumes from its slot's
state, from the snapshot its StepSeq names, or from nothing at position 0, and asserts the state it
resumes from is that of the very tokens its pages hold. So a hit without a snapshot, a snapshot of
another prefix, or one overwritten by a save in the same step fails here, not only its tokens.
"""

import random

import pytest

from jaxstream.config import ConfigError, load_config
from jaxstream.kv_memory import state_rows, state_snapshots
from scheduler_svc.core import Scheduler, StepPlan
from scheduler_svc.pages import PageAllocator
from scheduler_svc.radix import RadixCache, prefix_cache
from scheduler_svc.snapshots import SnapshotPool
from tests.unit.test_scheduler_core import FakeWorker, check_state, drive, reference, req


def fold(state: int, token: int) -> int:
    return (state * 31 + token + 1) % 1_000_003


class HybridWorker(FakeWorker):
    def __init__(self, page_size: int, rows: int, check: Scheduler | None = None):
        """`check`: assert its snapshot pool's bookkeeping before every step."""
        super().__init__(page_size)
        self.check = check
        self.states: dict[int, tuple[int, int]] = {}  # slot -> (position, state)
        self.snapshots: dict[int, tuple[int, int]] = {}  # row -> (position, state)
        self.rows = rows
        self.reads = 0  # seqs that started from a snapshot

    def run(self, plan: StepPlan):
        if self.check is not None:
            check_pool(self.check)
        reads = {q.state_from for q in plan.seqs if q.state_from >= 0}
        assert not reads & {q.state_to for q in plan.seqs if q.state_to >= 0}, "a snapshot read and saved in one step"
        for q in plan.seqs:
            r, ps = q.request, self.page_size
            if q.start == 0:
                position, state = 0, 0
            elif q.state_from >= 0:
                assert 0 <= q.state_from < self.rows
                position, state = self.snapshots[q.state_from]
                self.reads += 1
            else:
                position, state = self.states[r.slot]
            assert position == q.start, f"{r.rid} resumes at {q.start} from a state at {position}"
            held = 0
            for p in range(q.start):  # the tokens its pages hold before this step
                held = fold(held, self.cache[r.pages[p // ps], p % ps])
            assert state == held, f"{r.rid}: the state it resumes from is not its prefix's"
            fed = [self.slots[r.slot]] if q.follows else q.tokens
            for token in fed:
                state = fold(state, token)
            self.states[r.slot] = (q.context_len, state)
            if q.state_to >= 0:
                assert 0 <= q.state_to < self.rows and q.context_len % ps == 0 and not q.follows
                self.snapshots[q.state_to] = (q.context_len, state)
        return super().run(plan)


def make(rows=4, num_pages=256, page_size=4, token_budget=64, max_running=8) -> Scheduler:
    allocator = PageAllocator(num_pages)
    return Scheduler(max_running=max_running, token_budget=token_budget, page_size=page_size, allocator=allocator,
                     cache=prefix_cache(page_size, allocator, True, rows))


def check_pool(s: Scheduler) -> None:
    """Every row is free, held by exactly one node of the tree, or saving for a running request."""
    pool = s.cache.snapshots
    held = [n.snapshot for n in s.cache.nodes() if n.snapshot >= 0]
    saving = [r.snapshot[0] for r in s.running if r.snapshot is not None and r.snapshot[2] == pool.epoch]
    assert len(set(held + saving)) == len(held) + len(saving) == pool.num_used


def test_a_hit_ends_at_the_deepest_node_holding_a_snapshot():
    allocator = PageAllocator(16)
    pool = SnapshotPool(2)
    cache = RadixCache(2, allocator, pool)
    deep, pages = cache.insert([1, 2, 3, 4, 5, 6], allocator.allocate(3))
    assert cache.match([1, 2, 3, 4, 5, 6, 7]) == (cache.root, [])  # pages, but no state: no hit
    pool.attach(deep.parent, pool.take(), pool.epoch)
    node, hit = cache.match([1, 2, 3, 4, 5, 6, 7])
    assert node is deep.parent and hit == pages[:2]
    pool.attach(deep, pool.take(), pool.epoch)
    assert cache.match([1, 2, 3, 4, 5, 6, 7])[1] == pages
    assert cache.evict(1) == 1 and pool.num_used == 1  # the leaf went, and its row with it
    assert prefix_cache(2, allocator, True, 0) is None and prefix_cache(2, allocator, False, 4) is None
    assert prefix_cache(2, allocator, True, None).snapshots is None  # not a hybrid


def test_a_prefill_ends_at_the_last_reusable_page_boundary_and_saves_its_state_there():
    s = make()
    s.add(req("a", range(1, 12), max_new=2))  # 11 tokens: 10 reusable, the boundary at 8
    plans: list[StepPlan] = []
    drive(s, HybridWorker(4, 4), plans=plans)
    first, second = plans[0].seqs[0], plans[1].seqs[0]
    assert (first.start, first.context_len, first.sample, first.state_to) == (0, 8, False, 0)
    assert (second.start, second.context_len, second.state_to) == (8, 11, -1)
    assert [n.snapshot for n in s.cache.nodes() if n.snapshot >= 0] == [0] and s.stats()["state_snapshots_used"] == 1


def test_a_hit_starts_from_the_snapshot_and_samples_what_a_miss_does():
    s = make()
    worker = HybridWorker(4, 4)
    prompt = list(range(1, 12))
    s.add(req("a", prompt, max_new=5))
    drive(s, worker)
    s.add(req("b", prompt + [50, 51, 52, 53, 54], max_new=5))
    s.add(req("c", prompt, max_new=5))
    done = drive(s, worker, depth=2)
    assert worker.reads == 2
    assert done["b"].request.cached_tokens == 8 and done["c"].request.cached_tokens == 8
    assert done["c"].request.output == reference(prompt, 5)
    assert done["b"].request.output == reference(prompt + [50, 51, 52, 53, 54], 5)


def test_with_no_row_free_the_least_recently_used_snapshot_goes_and_its_pages_stay():
    s = make(rows=1)
    worker = HybridWorker(4, 1)
    x, y = list(range(1, 10)), list(range(100, 109))
    for rid, prompt in (("x", x), ("y", y)):
        s.add(req(rid, prompt, max_new=1))
        drive(s, worker)
    assert s.cache.match(y, touch=False)[1] and not s.cache.match(x, touch=False)[1]  # x's snapshot gave y its row
    assert s.cache.num_pages == 4  # x's pages are still cached
    s.add(req("x2", x, max_new=3))
    done = drive(s, worker)
    assert done["x2"].request.cached_tokens == 0 and done["x2"].request.output == reference(x, 3)


def test_a_snapshot_read_in_a_step_is_not_given_to_a_save_in_that_step():
    s = make(rows=1)
    worker = HybridWorker(4, 1)
    x = list(range(1, 10))
    s.add(req("x", x, max_new=1))
    drive(s, worker)
    s.add(req("hit", x + [7, 7], max_new=2))
    s.add(req("other", list(range(200, 209)), max_new=2))  # would save at 8: the only row is being read
    plan = s.plan()
    seqs = {q.request.rid: q for q in plan.seqs}
    assert seqs["hit"].state_from == 0 and seqs["other"].state_to == -1 and seqs["other"].context_len == 8
    s.absorb(plan, worker.run(plan))
    done = drive(s, worker)
    assert done["other"].request.output == reference(list(range(200, 209)), 2)


def test_flush_and_invalidate_free_every_row_and_a_save_in_flight_is_not_attached():
    s = make(rows=2)
    worker = HybridWorker(4, 2)
    s.add(req("a", list(range(1, 10)), max_new=1))
    drive(s, worker)
    assert s.cache.snapshots.num_used == 1
    s.flush_cache()
    assert s.cache.snapshots.num_used == 0
    s.add(req("b", list(range(1, 18)), max_new=2))
    plan = s.plan()  # b's first chunk saves at 16
    assert plan.seqs[0].state_to >= 0
    s.invalidate_cache()  # as a flush with a request frozen in place: b keeps its own state, nothing is cached
    assert s.cache.snapshots.num_used == 0
    s.absorb(plan, worker.run(plan))
    drive(s, worker)
    assert s.cache.snapshots.num_used == 0 and not [n for n in s.cache.nodes() if n.snapshot >= 0]


def test_many_requests_sharing_prefixes_under_retraction_and_overlap_keep_every_state_right():
    rng = random.Random(7)
    roots = [[rng.randrange(1, 900) for _ in range(rng.randrange(3, 14))] for _ in range(4)]
    s = make(rows=3, num_pages=12, token_budget=16, max_running=4)
    worker = HybridWorker(4, 3, check=s)
    prompts = {}
    for i in range(40):
        prompts[f"r{i}"] = rng.choice(roots) + [rng.randrange(1, 900) for _ in range(rng.randrange(0, 9))]
        s.add(req(f"r{i}", prompts[f"r{i}"], max_new=rng.randrange(2, 12)))
    done = drive(s, worker, depth=2)
    assert len(done) == 40 and s.counters.preempted_total > 0 and worker.reads > 0
    for rid, f in done.items():
        assert f.request.output == reference(prompts[rid], len(f.request.output))
    assert s.cache.snapshots.num_used == s.cache.snapshots.num_held  # no save left pending at idle


def test_the_state_rows_are_the_request_slots_then_the_snapshots_and_a_negative_count_is_refused():
    cfg = load_config(["scheduler.max_running_requests=8", "scheduler.state_snapshots=3"])
    assert (state_snapshots(cfg), state_rows(cfg)) == (3, 11)
    cfg = load_config(["scheduler.max_running_requests=8", "scheduler.state_snapshots=3", "scheduler.prefix_cache=false"])
    assert (state_snapshots(cfg), state_rows(cfg)) == (0, 8)
    with pytest.raises(ConfigError, match=r"^scheduler.state_snapshots: must be >= 0, got -1"):
        load_config(["scheduler.state_snapshots=-1"])
