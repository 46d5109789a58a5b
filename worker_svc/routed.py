"""Routed experts export (SGLang's "R3", worker.enable_return_routed_experts): which experts each
MoE layer chose for every position a request ran, for a trainer to replay the same routing.

With the switch on (and a model with MoE layers), the engine compiles its forward to also return
the step's choices, [L, T, k] i32 (layers/decoder.py; dense layers' rows 0, SGLang's rule), and
writes them into a device buffer of one row per KV cache slot, [Y, L, k], with the step's write
slots exactly as the KV cache is written. So a position the prefix cache gives a later request
still has its row: the request's first step since admission reads the rows of its cached prefix
back through the page table (`lookup`, one compiled shape of `chunk` slots). A weight update
empties the prefix cache, so no row of older weights is ever read back.

Only when some seq of a step asked (SamplingParams.return_routed_experts) does anything come back
to the host: the step's [L, T, k] and the cached prefixes' rows, cut to the asking seqs' positions
from their routed_experts_start_len on, one protocol.RoutedExperts per seq. With the switch off
nothing here exists and the compiled step is the one without it.

Shapes in the legend of worker_svc/__init__.py (Y: KV cache slots, P * Z).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream.arrays import from_wire, to_wire
from jaxstream.protocol import RoutedExperts, SamplingParams, Step
from worker_svc.positions import first_position


def write(buffer: jax.Array, routed: jax.Array, slots: jax.Array) -> jax.Array:
    """buffer [Y, L, k], routed [L, T, k], slots [T] (padding out of range: dropped) -> the buffer
    with each token's row in its slot (donated: in place)."""
    return buffer.at[slots].set(jnp.swapaxes(routed, 0, 1), mode="drop")


def lookup(buffer: jax.Array, slots: jax.Array) -> jax.Array:
    """buffer [Y, L, k], slots [C] -> [C, L, k]; a slot out of range (padding) reads 0."""
    return jnp.take(buffer, slots, axis=0, mode="fill", fill_value=0)


class ExpertsCapture:
    """The device buffer of routed experts per KV slot, and the host side of a step's export."""

    def __init__(self, layers: int, top_k: int, num_slots: int, page_size: int, chunk: int, sharding: Any = None) -> None:
        self.shape = (num_slots, layers, top_k)  # [Y, L, k]
        self.page_size, self.chunk, self.sharding = page_size, chunk, sharding
        self._zeros = jax.jit(lambda: jnp.zeros(self.shape, jnp.int32), out_shardings=sharding)
        self.buffer = self._zeros()
        self._lookup = jax.jit(lookup)
        self.lookups: dict[int, Any] = {}  # chunk -> executable

    def compile(self) -> None:
        """The lookup's one shape, and the empty buffer (a resume makes one without compiling)."""
        slots = jax.ShapeDtypeStruct((self.chunk,), jnp.int32, sharding=self.sharding)
        self.lookups[self.chunk] = self._lookup.lower(jax.ShapeDtypeStruct(self.shape, jnp.int32, sharding=self.sharding), slots).compile()
        if not isinstance(self._zeros, jax.stages.Compiled):
            self._zeros = self._zeros.lower().compile()

    def release(self) -> None:
        self.buffer.delete()

    def resume(self) -> None:
        self.buffer = self._zeros()

    @staticmethod
    def wanted(params: list[SamplingParams]) -> dict[int, int]:
        """{row of the step: its first position to return} for the seqs whose request asked."""
        return {row: p.routed_experts_start_len for row, p in enumerate(params) if p.return_routed_experts}

    def prefixes(self, step: Step, wanted: dict[int, int]) -> list[tuple[int, int, list[Any], int]]:
        """Start reading the rows of the cached prefix [start, p0) of each asking seq that is its
        request's first since admission (it brings its sampling): (row, start, device chunks [C, L, k], n)
        per seq, read back by `rows`. Dispatched before the step's forward, which writes only
        positions from p0 on."""
        out, table = [], None
        for row, start in wanted.items():
            seq = step.seqs[row]
            p0 = first_position(seq)
            if seq.sampling is None or p0 <= start:
                continue
            table = from_wire(step.page_table) if table is None else table
            positions = np.arange(start, p0)
            slots = table[row, positions // self.page_size] * self.page_size + positions % self.page_size
            parts = []
            for i in range(0, len(slots), self.chunk):  # padding slots (out of range) read 0 and are cut below
                part = np.full(self.chunk, self.shape[0], np.int32)
                part[: len(slots[i : i + self.chunk])] = slots[i : i + self.chunk]
                parts.append(self._executable()(self.buffer, part))
            out.append((row, start, parts, len(slots)))
        return out

    def _executable(self) -> Any:
        if self.chunk not in self.lookups:  # without compile(): a test of a few shapes
            self.compile()
        return self.lookups[self.chunk]

    def rows(self, step: Step, wanted: dict[int, int], prefixes: list, computed: list[tuple[Any, Any]]) -> tuple[RoutedExperts, ...]:
        """One RoutedExperts per asking seq with rows at positions >= its start: its cached prefix's
        (`prefixes`) and those its tokens computed in each sub-step (`computed`: (the sub-step's
        inputs, its routed [L, T, k] on the device))."""
        pieces: dict[int, list[tuple[int, np.ndarray]]] = {row: [] for row in wanted}
        for row, start, parts, count in prefixes:
            pieces[row].append((start, np.concatenate([np.asarray(p) for p in parts])[:count]))
        for inputs, routed in computed:
            routed = np.asarray(routed)  # [L, T, k]: the whole step, one read-back
            segment, positions = inputs.ctx.segment, inputs.ctx.positions
            for row, start in wanted.items():
                keep = np.flatnonzero((segment == row) & (positions >= start))  # a row's tokens: contiguous positions
                if len(keep):
                    pieces[row].append((int(positions[keep[0]]), routed[:, keep].swapaxes(0, 1)))
        out = []
        for row, found in pieces.items():
            if not found:
                continue
            found.sort(key=lambda piece: piece[0])
            assert all(a + len(x) == b for (a, x), (b, _) in zip(found, found[1:])), f"{step.seqs[row].rid}: routed rows not contiguous"
            out.append(RoutedExperts(step.seqs[row].rid, found[0][0], to_wire(np.concatenate([x for _, x in found]).astype(np.int32))))
        return tuple(out)
