"""The prefix cache: KV pages already computed, found again by the tokens they hold.

A radix tree whose every edge is one whole page: `page_size` token ids -> the KV page holding
their keys and values. A node's page was computed after the tokens of every node above it, so a
path from the root is a token prefix whose KV any request starting with those tokens can read
instead of computing it. Only whole pages are cached (a partial page is still being written).

The tree owns the pages of its nodes (allocated from the scheduler's PageAllocator, given back
by `evict` and `flush`). A running request reading a path pins it: every node on it counts the
requests that pin it (`refs`), and a pinned node is never evicted. So a node's `refs` is at least
any child's, and the unpinned nodes are whole subtrees: `evict` frees their leaves, least
recently used first (a counter, not a clock), a freed leaf's parent becoming a leaf in turn.

A prefix's KV depends on the LoRA adapter it ran under: each adapter load has its own `namespace`
(scheduler_svc/adapters.py's generation; 0: the base model), which keys the edges below the root
beside the first page's tokens (as vLLM's and SGLang's caches key by the LoRA id). So a path is
only ever matched under the namespace it was inserted under.

For a hybrid model (linear-attention layers keeping a per-request state) a node may hold a
snapshot of that state (`snapshots`: snapshots.py); a match then ends at the deepest node on its
path holding one, and a node leaving the tree frees its snapshot.

Pure: no clock, no I/O. Invariants (tests check them):
- every node but the root holds one page; no page is in two nodes;
- refs(node) == the number of pins on paths through it, >= the refs of each child;
- `num_pages` nodes hold pages, `num_pinned` of them have refs > 0.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from jaxstream.english import counted
from scheduler_svc.pages import PageAllocator
from scheduler_svc.snapshots import SnapshotPool


class Node:
    __slots__ = ("parent", "key", "page", "children", "refs", "used", "stale", "snapshot")

    def __init__(self, parent: Node | None, key: tuple[int, ...], page: int) -> None:
        self.parent = parent
        self.key = key  # the page's token ids
        self.page = page  # -1 at the root
        self.children: dict[tuple[int, ...], Node] = {}
        self.refs = 0  # pins on paths through this node
        self.used = 0  # the LRU counter when last matched or inserted
        self.stale = False  # cut off by `invalidate`: never matched again, freed when unpinned
        self.snapshot = -1  # the state row holding a hybrid's state after this node's page (snapshots.py); -1: none

    def path(self) -> list[Node]:
        """This node and its ancestors, deepest first, root excluded."""
        nodes, node = [], self
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes


def prefix_cache(page_size: int, allocator: PageAllocator, enabled: bool, snapshots: int | None = None) -> RadixCache | None:
    """The prefix cache scheduler.prefix_cache asks for (`enabled`). `snapshots`: for a hybrid model,
    the state snapshots kept (scheduler.state_snapshots; with none, no hit could restore the state,
    so there is no cache); None for any other model."""
    if not enabled or snapshots == 0:
        return None
    return RadixCache(page_size, allocator, SnapshotPool(snapshots) if snapshots else None)


class RadixCache:
    def __init__(self, page_size: int, allocator: PageAllocator, snapshots: SnapshotPool | None = None) -> None:
        """`snapshots`: a hybrid model's state snapshots (snapshots.py); None: a model without
        recurrent state, whose every cached path is a hit."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.allocator = allocator
        self.snapshots = snapshots
        self.root = Node(None, (), -1)
        self.num_pages = 0  # nodes holding a page, stale ones included
        self.num_pinned = 0  # of them, those with refs > 0
        self._clock = 0
        # Candidates for eviction as (used, tie, node): leaves with refs 0 when pushed; checked when
        # popped (a node pinned, grown a child or used since then is skipped or pushed anew).
        self._heap: list[tuple[int, int, Node]] = []
        self._tie = itertools.count()

    @property
    def num_evictable(self) -> int:
        """Pages that `evict` could free: those no running request reads."""
        return self.num_pages - self.num_pinned

    def match(self, tokens: Sequence[int], touch: bool = True, namespace: int = 0) -> tuple[Node, list[int]]:
        """(the deepest node, its path's pages) for the longest cached prefix of `tokens` made of
        whole pages, under `namespace`. `touch`: count the path as used now (LRU); a mere look (lpm's) does not.
        With snapshots, the path ends at its deepest node holding one (snapshots.py, 1.)."""
        node, pages, ps = self.root, [], self.page_size
        tick = self._tick() if touch else 0
        for start in range(0, len(tokens) - ps + 1, ps):
            child = node.children.get(self._key(node, tokens[start : start + ps], namespace))
            if child is None:
                break
            if touch:
                child.used = tick
            node = child
            pages.append(node.page)
        if touch:
            self._offer(node)  # used now: its place in the eviction order moves
        if self.snapshots is not None:
            node, up = self.snapshots.cut(node)
            del pages[len(pages) - up :]
        return node, pages

    def insert(self, tokens: Sequence[int], pages: Sequence[int], start: Node | None = None,
               namespace: int = 0) -> tuple[Node, list[int]]:
        """Cache `pages`, the KV of `tokens` (len(pages) whole pages) following the path to `start`
        (the root by default; `namespace` keys a path from the root). The tree takes every page: it keeps those it lacked and frees the
        others (it holds their KV already, in pages of its own). Returns (the deepest node, the
        tree's pages for `tokens`), which replace the caller's."""
        ps = self.page_size
        if len(tokens) != len(pages) * ps:
            raise ValueError(f"{counted(len(tokens), 'token')} for {counted(len(pages), 'page')} of {ps}: not whole pages")
        node = self.root if start is None else start
        if node.stale:
            raise ValueError("inserting under a node cut off by invalidate")
        tick = self._tick()
        kept, duplicates = [], []
        for i, page in enumerate(pages):
            key = self._key(node, tokens[i * ps : (i + 1) * ps], namespace)
            child = node.children.get(key)
            if child is None:
                child = Node(node, key, page)
                node.children[key] = child
                self.num_pages += 1
            elif child.page != page:
                duplicates.append(page)
            child.used = tick
            node = child
            kept.append(node.page)
        if duplicates:
            self.allocator.free(duplicates)
        self._offer(node)  # a new leaf is evictable until pinned
        return node, kept

    def pin(self, node: Node, above: Node | None = None) -> None:
        """Pin the path to `node`; only its part below `above` (an ancestor already pinned by the
        same request, which keeps that pin) when given."""
        while node is not above and node.parent is not None:
            if node.refs == 0:
                self.num_pinned += 1
            node.refs += 1
            node = node.parent

    def unpin(self, node: Node) -> None:
        """Drop one pin of the path to `node`."""
        for n in node.path():
            if n.refs < 1:
                raise RuntimeError(f"unpinning page {n.page}, which is not pinned")
            n.refs -= 1
            if n.refs == 0:
                self.num_pinned -= 1
                if n.stale:
                    self._remove(n)  # its pinned descendants are gone already: unpinned deepest first
                else:
                    self._offer(n)

    def evict(self, n: int) -> int:
        """Free up to `n` pages that no request pins, least recently used leaves first; returns how
        many were freed."""
        freed: list[int] = []
        while len(freed) < n and self._heap:
            used, _, node = heapq.heappop(self._heap)
            if not self._evictable(used, _, node):
                continue  # pinned, grown, evicted or used again since it was offered
            parent = node.parent
            freed.append(node.page)
            self._detach(node)
            self._offer(parent)
        self.allocator.free(freed)
        if len(self._heap) > 4 * (self.num_pages + 64):  # mostly stale entries: rebuild
            self._heap = [e for e in self._heap if self._evictable(*e)]
            heapq.heapify(self._heap)
        return len(freed)

    def flush(self) -> int:
        """Free every page; only when nothing is pinned (RuntimeError otherwise). Returns how many."""
        if self.num_pinned:
            raise RuntimeError(f"flushing the prefix cache while {self.num_pinned} of its pages are in use")
        freed = self.num_pages
        self.invalidate()
        return freed

    def invalidate(self) -> None:
        """Forget every page (their KV is lost: the worker restarted). Unpinned pages are freed now;
        pinned ones are cut off from the tree and freed as their last pin drops."""
        stack, unpinned = list(self.root.children.values()), []
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            node.stale = True
            if node.refs == 0:
                unpinned.append(node)
        for node in unpinned:  # a subtree each: pins cover ancestors
            node.parent.children.pop(node.key, None)
            node.parent = None
        self.allocator.free([n.page for n in unpinned])
        self.num_pages -= len(unpinned)
        if self.snapshots is not None:  # the states go with the pages
            self.snapshots.clear()
        self.root = Node(None, (), -1)
        self._heap = []

    def nodes(self) -> list[Node]:
        """Every node holding a page and reachable from the root (for tests and checks)."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # -- internals

    def _key(self, node: Node, page: Sequence[int], namespace: int) -> tuple[int, ...]:
        """An edge's key: the page's tokens, below the root led by -namespace (no token id is negative,
        and the key is one longer: no base model's page has it)."""
        return (-namespace, *page) if namespace and node is self.root else tuple(page)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    @staticmethod
    def _evictable(used: int, _: int, node: Node) -> bool:
        return not node.refs and not node.children and node.parent is not None and node.used == used and not node.stale

    def _offer(self, node: Node) -> None:
        if node.parent is not None and not node.refs and not node.children and not node.stale:
            heapq.heappush(self._heap, (node.used, next(self._tie), node))

    def _detach(self, node: Node) -> None:
        if self.snapshots is not None:
            self.snapshots.drop(node)
        del node.parent.children[node.key]
        node.parent = None
        self.num_pages -= 1

    def _remove(self, node: Node) -> None:
        """A stale node's last pin dropped: free its page."""
        if node.parent is not None:
            node.parent.children.pop(node.key, None)
            node.parent = None
        self.num_pages -= 1
        self.allocator.free([node.page])
