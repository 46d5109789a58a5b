"""The KV page allocator: all-or-nothing allocation, exact accounting, double frees caught."""

import random

import pytest

from scheduler_svc.pages import PageAllocator


def test_fresh_pool_hands_out_distinct_pages_in_order():
    a = PageAllocator(8)
    assert (a.num_pages, a.num_free, a.num_used) == (8, 8, 0)
    first, second = a.allocate(3), a.allocate(2)
    assert first == [0, 1, 2] and second == [3, 4]
    assert (a.num_free, a.num_used) == (3, 5)


def test_allocation_is_all_or_nothing():
    a = PageAllocator(4)
    assert a.allocate(3) == [0, 1, 2]
    assert a.allocate(2) is None  # only one left: nothing is taken
    assert (a.num_free, a.num_used) == (1, 3)
    assert a.allocate(1) == [3]
    assert a.allocate(1) is None
    assert a.allocate(0) == []


def test_freed_pages_are_reused():
    a = PageAllocator(3)
    pages = a.allocate(3)
    a.free(pages[:2])
    assert (a.num_free, a.num_used) == (2, 1)
    again = a.allocate(2)
    assert sorted(again) == pages[:2]
    assert a.allocate(1) is None


@pytest.mark.parametrize("bad", [[0, 0], [5], [1]])
def test_freeing_unallocated_page_raises_and_frees_nothing(bad):
    a = PageAllocator(6)
    a.allocate(1)  # page 0 is allocated, pages 1.. are not
    with pytest.raises(RuntimeError, match="not allocated"):
        a.free(bad)
    assert (a.num_free, a.num_used) == (5, 1)  # the failed free changed nothing


def test_double_free_raises():
    a = PageAllocator(2)
    pages = a.allocate(2)
    a.free(pages)
    with pytest.raises(RuntimeError, match=r"\[0, 1\]"):
        a.free(pages)
    assert a.num_free == 2


def test_invalid_sizes_raise():
    with pytest.raises(ValueError):
        PageAllocator(0)
    with pytest.raises(ValueError):
        PageAllocator(2).allocate(-1)


def test_random_allocate_free_keeps_exact_accounting():
    for seed in range(20):
        rng = random.Random(seed)
        n = rng.randint(1, 40)
        a = PageAllocator(n)
        held: list[list[int]] = []
        for _ in range(300):
            if held and rng.random() < 0.45:
                a.free(held.pop(rng.randrange(len(held))))
            else:
                want = rng.randint(0, n // 2 + 1)
                got = a.allocate(want)
                owned = sum(map(len, held))
                assert (got is None) == (want > n - owned)
                if got is not None:
                    assert len(got) == want
                    held.append(got)
            flat = [p for block in held for p in block]
            assert len(flat) == len(set(flat)) and all(0 <= p < n for p in flat)
            assert a.num_used == len(flat) and a.num_free == n - len(flat)
        for block in held:
            a.free(block)
        assert a.num_free == n
