"""The KV page allocator: which of the pool's pages are free.

Pages are ints in [0, num_pages). Who owns an allocated page is the scheduler's business; this module
guarantees that a page is never handed out twice, and catches a double free where it happens instead
of letting it surface later as two requests overwriting each other's KV.
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxstream.english import counted


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self._num_pages = num_pages
        # A stack with the lowest id on top: a fresh pool hands out 0, 1, 2, ... (readable in tests).
        self._free = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()
        # Invariant: _used and set(_free) partition range(num_pages).

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int] | None:
        """`n` pages, or None, taking nothing, when fewer than `n` are free (all or nothing)."""
        if n < 0:
            raise ValueError(f"cannot allocate {counted(n, 'page')}")
        if n > len(self._free):
            return None
        pages = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        self._used.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Give pages back. A page that is not allocated (freed twice, or never handed out) is a bug
        in the caller: it raises RuntimeError and frees nothing."""
        pages = list(pages)
        seen: set[int] = set()
        bad = []
        for page in pages:
            if page in seen or page not in self._used:
                bad.append(page)
            seen.add(page)
        if bad:
            raise RuntimeError(f"freeing pages that are not allocated (double free?): {bad}")
        self._used.difference_update(pages)
        self._free.extend(reversed(pages))
