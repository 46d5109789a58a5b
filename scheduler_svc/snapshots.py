"""Snapshots of a hybrid model's recurrent state, kept at prefix cache nodes (issue 45).

A hybrid's linear-attention layers (worker_svc/layers/delta_net.py) keep no KV per token but one
state per request, so a prefix's KV pages alone cannot resume it: a hit needs the state the
linear layers had at the prefix's end. The worker keeps `rows` extra state rows beside its request
slots (`scheduler.state_snapshots`); this pool says which of them holds the state at which cache
node (radix.py's `Node.snapshot`, -1: none), as SGLang's MambaRadixCache keeps a state per node.

The rules (core.py and request_pages.py call them):
1. Match: a hybrid's hit is cut back to the deepest node on its path holding a snapshot
   (`cut`, called by RadixCache.match), since positions past it would need a state nobody kept.
2. Align (vLLM's mamba "align" mode): a prefill that would cross P, the last page boundary of the
   tokens a later request could reuse (RequestPages.reusable), ends its chunk at P, and the worker
   saves the state there into a row `take`n for it (StepSeq.state_to). When those pages join the
   cache, the node at P gets the row (`attach`; a node that has one already keeps its own).
3. Read: a request admitted on a hit starts its linear layers from the node's row
   (StepSeq.state_from). A row read by the step being planned is never given to a save in that
   same step (`reading`): the worker would write it before the reader's layers read it. A row
   read by an earlier step may be reused: the worker runs steps in order.
4. Free: a row goes with its node (evicted, flushed, invalidated: `drop`, `clear`); with none free,
   `take` evicts the least recently used node's snapshot (its pages stay: shorter hits cut to an
   ancestor). A row taken for a save whose pages never join the cache (the worker that computed them
   is gone) is given back by `forget`. `clear` (the worker's states are gone) bumps `epoch`, so a
   save planned before it can neither attach nor free a row it no longer owns.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler_svc.radix import Node


class SnapshotPool:
    def __init__(self, rows: int) -> None:
        if rows < 1:
            raise ValueError(f"a snapshot pool needs >= 1 row, got {rows}")
        self.rows = rows
        self._free = list(range(rows - 1, -1, -1))  # popped from the end: lowest first
        self._held: dict[int, Node] = {}  # row -> the node whose snapshot it is
        self.reading: set[int] = set()  # rows the step being planned reads (3.)
        self.epoch = 0  # bumped by `clear` (4.)

    @property
    def num_used(self) -> int:
        """Rows held by a node or taken for a save in flight."""
        return self.rows - len(self._free)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def new_plan(self) -> None:
        """A plan starts: the rows the previous one read are safe to overwrite now (3.)."""
        self.reading.clear()

    @staticmethod
    def cut(node: Node) -> tuple[Node, int]:
        """The deepest node at or above `node` holding a snapshot (the root if none), and how many
        levels up it is (1.)."""
        up = 0
        while node.parent is not None and node.snapshot < 0:
            node, up = node.parent, up + 1
        return node, up

    def read(self, node: Node) -> None:
        """A request admitted at `node` reads its snapshot in the step being planned (3.)."""
        if node.snapshot >= 0:
            self.reading.add(node.snapshot)

    def take(self) -> int:
        """A row for a save (2.): a free one, else the least recently used snapshot no read of this
        plan needs (4.); -1 when every row is read by this plan or saving."""
        if not self._free:
            victims = [node for row, node in self._held.items() if row not in self.reading]
            if not victims:
                return -1
            self.drop(min(victims, key=lambda node: node.used))
        return self._free.pop()

    def attach(self, node: Node, row: int, epoch: int) -> None:
        """The save into `row` (taken under `epoch`) is the state at `node`, whose pages just joined
        the cache (2.). A node with a snapshot already keeps it; the row is freed."""
        if epoch != self.epoch:
            return  # cleared since: the row is not ours any more
        if node.snapshot >= 0 or node.stale:
            self._free.append(row)
            return
        node.snapshot = row
        self._held[row] = node

    def forget(self, row: int, epoch: int) -> None:
        """A save whose pages never joined the cache: its row is free again (4.)."""
        if epoch == self.epoch:
            self._free.append(row)

    def drop(self, node: Node) -> None:
        """`node` leaves the cache, or loses its snapshot to a save: free its row."""
        if node.snapshot >= 0:
            del self._held[node.snapshot]
            self._free.append(node.snapshot)
            node.snapshot = -1

    def clear(self) -> None:
        """Every row is free: the worker's states are gone, or so is the cache (4.)."""
        for node in self._held.values():
            node.snapshot = -1
        self._held.clear()
        self._free = list(range(self.rows - 1, -1, -1))
        self.reading.clear()
        self.epoch += 1

    def stats(self) -> dict[str, int]:
        return {"state_snapshots_total": self.rows, "state_snapshots_used": self.num_used}
