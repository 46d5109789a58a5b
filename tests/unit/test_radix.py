"""The prefix cache's radix tree, from lists of ints: matching, inserting, pins, LRU eviction, flush."""

import random

import pytest

from scheduler_svc.pages import PageAllocator
from scheduler_svc.radix import RadixCache

PS = 4


def make(num_pages=64, page_size=PS):
    allocator = PageAllocator(num_pages)
    return RadixCache(page_size, allocator), allocator


def cached(cache, allocator, tokens):
    """Allocate pages for the whole pages of `tokens` and insert them; the tree's pages back."""
    pages = allocator.allocate(len(tokens) // cache.page_size)
    return cache.insert(tokens[: len(pages) * cache.page_size], pages)


def check(cache, allocator, pins=()):
    """The tree's invariants: one page per node, no page twice, refs = pins through the node."""
    nodes = cache.nodes()
    pages = [n.page for n in nodes]
    assert len(pages) == len(set(pages)) == cache.num_pages
    assert allocator.num_used >= cache.num_pages
    expected = {id(n): 0 for n in nodes}
    for node in pins:
        for n in node.path():
            expected[id(n)] += 1
    for n in nodes:
        assert n.refs == expected[id(n)]
        assert all(c.refs <= n.refs for c in n.children.values())
    assert cache.num_pinned == sum(1 for n in nodes if n.refs)


def test_match_takes_whole_pages_of_the_longest_common_prefix():
    cache, allocator = make()
    tokens = list(range(10, 22))  # three pages
    node, pages = cached(cache, allocator, tokens)
    assert pages == [0, 1, 2] and cache.num_pages == 3
    assert cache.match(tokens)[1] == [0, 1, 2]
    assert cache.match(tokens + [7, 7])[1] == [0, 1, 2]
    assert cache.match(tokens[:11])[1] == [0, 1]  # the third page is not whole
    assert cache.match(tokens[:4] + [0] + tokens[5:])[1] == [0]  # diverges in the second page
    assert cache.match([1, 2, 3])[1] == [] and cache.match([])[1] == []
    assert cache.match(tokens)[0] is node
    check(cache, allocator)


def test_insert_keeps_what_it_lacked_and_frees_duplicates():
    cache, allocator = make()
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    cached(cache, allocator, a)  # pages 0, 1
    b = [1, 2, 3, 4, 9, 9, 9, 9, 5, 5, 5, 5]  # shares a's first page
    node, pages = cached(cache, allocator, b)  # pages 2, 3, 4 allocated: 2 duplicates page 0
    assert pages == [0, 3, 4]
    assert allocator.num_used == 4 and cache.num_pages == 4  # page 2 went back
    assert cache.match(b)[1] == [0, 3, 4] and cache.match(a)[1] == [0, 1]
    # Inserting pages the tree already holds (its own) frees nothing.
    assert cache.insert(a, [0, 1])[1] == [0, 1] and allocator.num_used == 4
    with pytest.raises(ValueError, match="whole pages"):
        cache.insert([1, 2, 3], [5])
    check(cache, allocator)


def test_insert_below_a_node_extends_its_path():
    cache, allocator = make()
    node, _ = cached(cache, allocator, [1, 2, 3, 4])
    deeper, pages = cache.insert([5, 6, 7, 8], allocator.allocate(1), start=node)
    assert deeper.parent is node and cache.match([1, 2, 3, 4, 5, 6, 7, 8])[1] == [0] + pages


def test_pinned_pages_are_never_evicted_and_unpinned_go_least_recently_used_first():
    cache, allocator = make(num_pages=8)
    old, _ = cached(cache, allocator, [1] * 8)  # pages 0, 1 (a chain: 1 is the leaf)
    mid, _ = cached(cache, allocator, [2] * 4)  # page 2
    new, _ = cached(cache, allocator, [3] * 4)  # page 3
    cache.pin(mid)
    cache.match([1] * 8)  # used again: now more recent than [3]
    assert cache.evict(1) == 1 and cache.match([3] * 4)[1] == []  # the least recently used unpinned
    assert cache.evict(10) == 2  # the chain, leaf first; the pinned page stays
    assert cache.match([1] * 8)[1] == [] and cache.match([2] * 4)[1] == [2]
    assert allocator.num_used == 1 and cache.num_pages == 1 and cache.num_evictable == 0
    check(cache, allocator, [mid])
    cache.unpin(mid)
    assert cache.num_evictable == 1 and cache.evict(1) == 1 and allocator.num_used == 0


def test_a_pinned_path_pins_its_ancestors_and_pin_above_adds_only_the_new_part():
    cache, allocator = make()
    top, _ = cached(cache, allocator, [1] * 4)
    cache.pin(top)
    below, _ = cache.insert([2] * 4, allocator.allocate(1), start=top)
    cache.pin(below, above=top)  # the same request, now pinning one page more
    other, _ = cached(cache, allocator, [1] * 4 + [3] * 4)
    cache.pin(other)
    assert (top.refs, below.refs, other.refs) == (2, 1, 1)
    check(cache, allocator, [below, other])
    assert cache.evict(10) == 0  # every page is on a pinned path
    cache.unpin(below)
    assert cache.evict(10) == 1 and cache.match([1] * 4 + [2] * 4)[1] == [0]
    cache.unpin(other)
    with pytest.raises(RuntimeError, match="not pinned"):
        cache.unpin(other)  # one pin too many: a bug in the caller, caught where it happens


def test_flush_frees_everything_but_only_when_nothing_is_pinned():
    cache, allocator = make()
    node, _ = cached(cache, allocator, list(range(12)))
    cached(cache, allocator, [5] * 8)
    cache.pin(node)
    with pytest.raises(RuntimeError, match="in use"):
        cache.flush()
    cache.unpin(node)
    assert cache.flush() == 5 and allocator.num_used == 0 and cache.num_pages == 0
    assert cache.match(list(range(12)))[1] == []


def test_invalidate_forgets_everything_and_frees_pinned_pages_when_unpinned():
    cache, allocator = make()
    pinned, _ = cached(cache, allocator, list(range(8)))
    cached(cache, allocator, [0, 1, 2, 3, 9, 9, 9, 9])  # shares the pinned path's first page
    cached(cache, allocator, [7] * 4)
    cache.pin(pinned)
    cache.invalidate()
    assert cache.match(list(range(8)))[1] == [] and cache.match([7] * 4)[1] == []
    assert cache.num_pages == 2 and allocator.num_used == 2  # the pinned path, until unpinned
    cache.unpin(pinned)
    assert cache.num_pages == 0 and allocator.num_used == 0


def test_evict_skips_entries_made_stale_by_use():
    cache, allocator = make()
    nodes = [cached(cache, allocator, [i] * 4)[0] for i in range(6)]
    for _ in range(50):  # many uses of the same leaves: the heap's stale entries are skipped
        for i in (0, 2, 4):
            cache.match([i] * 4)
    assert cache.evict(3) == 3
    assert [bool(cache.match([i] * 4)[1]) for i in range(6)] == [True, False, True, False, True, False]
    check(cache, allocator)
    assert nodes[1].parent is None


@pytest.mark.parametrize("seed", range(40))
def test_randomized_pages_are_never_double_owned_and_pinned_ones_never_evicted(seed):
    rng = random.Random(seed)
    ps = rng.choice([1, 2, 4])
    num_pages = rng.randint(8, 40)
    cache, allocator = make(num_pages, ps)
    alphabet = rng.randint(2, 4)  # few distinct tokens: prefixes are shared often
    pins: list = []  # one entry per live pin (a "request")
    own: list[int] = []  # pages held outside the tree (a request's private pages)
    for _ in range(300):
        op = rng.random()
        if op < 0.4:  # a request: match, pin, compute the rest in fresh pages, insert them below
            tokens = [rng.randrange(alphabet) for _ in range(rng.randint(0, 6 * ps))]
            node, pages = cache.match(tokens)
            cache.pin(node)
            fresh = (len(tokens) - len(pages) * ps) // ps
            new = allocator.allocate(fresh)
            if new is None:
                cache.evict(fresh - allocator.num_free)
                new = allocator.allocate(fresh)
            if new is None:  # pinned pages fill the pool
                cache.unpin(node)
                continue
            start = len(pages) * ps
            deeper, kept = cache.insert(tokens[start : start + fresh * ps], new, start=node)
            assert cache.match(tokens)[1] == pages + kept
            cache.pin(deeper, above=node)
            pins.append(deeper)
        elif op < 0.65 and pins:  # a request ends
            cache.unpin(pins.pop(rng.randrange(len(pins))))
        elif op < 0.8:  # pages for someone else, from the cache if need be
            n = rng.randint(1, 3)
            before = {id(n_): n_.page for n_ in cache.nodes() if n_.refs}
            if allocator.num_free < n:
                cache.evict(n - allocator.num_free)
            got = allocator.allocate(n)
            if got is not None:
                own += got
            assert {id(n_): n_.page for n_ in cache.nodes() if n_.refs} == before  # no pinned page evicted
        elif op < 0.9 and own:
            allocator.free([own.pop()])
        elif op < 0.95 and not pins:
            cache.flush()
        else:
            if rng.random() < 0.3:
                cache.invalidate()
                # stale pinned paths stay allocated until unpinned; treat them as gone from the tree
        tree = [n.page for n in cache.nodes()]
        assert not set(tree) & set(own), "a page is both in the tree and someone's own"
        stale_pinned = cache.num_pages - len(tree)
        assert allocator.num_used == len(tree) + len(own) + stale_pinned
        check_pins = [p for p in pins if not p.stale]
        if stale_pinned == 0:
            check(cache, allocator, check_pins)
    while pins:
        cache.unpin(pins.pop())
    cache.flush()
    allocator.free(own)
    assert allocator.num_used == 0
