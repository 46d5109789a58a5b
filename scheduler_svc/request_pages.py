"""Which KV pages each running request holds, over the page allocator and the prefix cache.

The bookkeeping of core.py's story, steps 2., 4. and 5.: an admitted request takes (and pins) its
longest reusable cached prefix; pages are allocated only when a step writes them, from the free
ones or the cache's unpinned ones, never another request's; whole pages a step computed join the
cache at the next plan; a request that stops running gives the cache its whole pages, frees the
rest and drops its pins. Which request yields when pages run out is the Scheduler's policy, not
this module's.

Page i of a request holds positions [i * page_size, (i + 1) * page_size); its first `shared` pages
are the path it pins in the cache (`node`), the rest its own.

For a hybrid model the cache keeps state snapshots beside the pages (snapshots.py): this module
applies its rules to a request's chunks (`chunk`, 2.), its admission (3.), its pages joining the
cache (2.) and its release (4.).
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler_svc.pages import PageAllocator
from scheduler_svc.radix import Node, RadixCache
from scheduler_svc.request import PlannedSeq, Request
from scheduler_svc.snapshots import SnapshotPool


class RequestPages:
    def __init__(self, allocator: PageAllocator, cache: RadixCache | None, page_size: int) -> None:
        """`cache`: the prefix cache, over the same allocator and page size; None: none."""
        self.allocator = allocator
        self.cache = cache
        self.page_size = page_size
        self.snapshots: SnapshotPool | None = cache.snapshots if cache is not None else None

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)  # ceil

    def allocate(self, req: Request, n: int) -> bool:
        """`n` more pages for `req` from the free ones or unpinned cache pages, never another request's."""
        pages = self.allocator.allocate(n)
        if pages is None and self.cache is not None and self.cache.evict(n - self.allocator.num_free):
            pages = self.allocator.allocate(n)
        req.pages += pages or []
        return pages is not None

    def trim(self, req: Request) -> None:
        """Free its pages past its computed positions (a draft's rejected tokens wrote them)."""
        keep = self.pages_for(req.computed)
        self.allocator.free(req.pages[keep:])
        del req.pages[keep:]

    @staticmethod
    def reusable(req: Request) -> int:
        """The most of its known tokens a request may take from the cache: all but the last (whose
        feeding samples, or ends a request that samples nothing), and none from the first prompt
        position it must still score, minus one (that position is scored by the logits of the one
        before it, which must be fed)."""
        limit = req.num_known - 1
        first = max(req.prompt_logprobs_from, req.scored_to)
        if req.prompt_logprobs_from >= 0 and first < len(req.prompt):
            limit = min(limit, max(first - 1, 0))
        return limit

    def admit(self, req: Request) -> None:
        """A request starts running: it takes and pins its longest reusable cached prefix."""
        if self.cache is None:
            return
        node, pages = self.cache.match(req.known(0, self.reusable(req)), namespace=req.namespace)
        if self.snapshots is not None:
            self.snapshots.read(node)
        self.cache.pin(node)
        req.node, req.pages, req.shared = node, pages, len(pages)
        req.computed = req.reused = len(pages) * self.page_size

    def cache_running(self, running: Iterable[Request]) -> None:
        """Hand the cache the whole pages earlier steps computed for running requests (a plan starts:
        with snapshots, no row is read by it yet)."""
        if self.cache is None:
            return
        if self.snapshots is not None:
            self.snapshots.new_plan()
        for req in running:
            if self._whole_pages(req) > req.shared and not req.kv_lost:
                old = req.node
                self._cache_pages(req, self._whole_pages(req))
                self.cache.pin(req.node, above=old)

    def release(self, req: Request) -> None:
        """A request stops running (ends, or is retracted): its whole computed pages go to the
        cache, the rest are freed, its pins dropped."""
        if self.cache is None or req.node is None:
            self.allocator.free(req.pages)
        else:
            pinned = req.node
            if not req.kv_lost and self._whole_pages(req) > req.shared:
                self._cache_pages(req, self._whole_pages(req))
            self.allocator.free(req.pages[req.shared :])
            self.cache.unpin(pinned)
        if req.snapshot is not None:  # its pages never reached the cache: nobody reads the row
            self.snapshots.forget(req.snapshot[0], req.snapshot[2])
        req.pages, req.shared, req.node, req.kv_lost, req.drafted, req.snapshot = [], 0, None, False, 0, None

    def chunk(self, req: Request, n: int) -> tuple[int, bool]:
        """Of `n` tokens the step could feed `req` from its computed ones, how many it feeds, and
        whether its state after them is saved: with snapshots, a chunk that would cross the last page
        boundary of its reusable tokens ends there (snapshots.py, 2.)."""
        if self.snapshots is None:
            return n, False
        at = self.reusable(req) // self.page_size * self.page_size
        if req.computed < at <= req.computed + n:
            return at - req.computed, True
        return n, False

    def snapshot_rows(self, seq: PlannedSeq, from_cache: bool) -> dict[str, int]:
        """StepSeq's state_from and state_to for a seq of a final plan: the snapshot its request's
        hit starts from, and a row for the save it plans (none when every row is read by this
        plan: the chunk ends at the boundary all the same)."""
        req, rows = seq.request, {}
        if self.snapshots is None:
            return rows
        if from_cache:
            rows["state_from"] = req.node.snapshot
        if seq.saves and (row := self.snapshots.take()) >= 0:
            req.snapshot = (row, seq.context_len, self.snapshots.epoch)
            rows["state_to"] = row
        return rows

    def _whole_pages(self, req: Request) -> int:
        """Its pages whose every position holds the KV of a known token (the one a seq that follows
        feeds is not known yet)."""
        return min(req.computed, req.num_known) // self.page_size

    def _cache_pages(self, req: Request, full: int) -> None:
        """Insert the request's pages [shared, full) into the cache below its node; it now reads the
        cache's pages there (its own duplicates are freed). Pins nothing."""
        ps = self.page_size
        node, pages = self.cache.insert(req.known(req.shared * ps, full * ps), req.pages[req.shared : full], start=req.node,
                                       namespace=req.namespace)
        req.pages[req.shared : full] = pages
        if req.snapshot is not None and req.snapshot[1] <= full * ps:  # the node at P takes the state saved there
            row, at, epoch = req.snapshot
            self.snapshots.attach(_up(node, full - at // ps), row, epoch)
            req.snapshot = None
        req.node, req.shared = node, full


def _up(node: Node, levels: int) -> Node:
    for _ in range(levels):
        node = node.parent
    return node
