"""How a step reads and writes the per-slot states (linear attention's: layers/paged.py's
CacheSpec.states) around a layer, so that the state arrays, which the decoder's layer scan carries,
are never an operand of the switch over layer kinds (layers/decoder.py).

A switch branch that passes an array through makes XLA copy it inside the scan's body: with the
whole state arrays handed to every branch, each full-attention layer copied both of them, a pass over
every slot's state per layer and step. Instead, before the switch the decoder gathers this layer's
start state for each row of the step ([R, ...]: `gather`), the layer turns those into each row's
end state ([R, ...]), and after the switch the decoder scatters them into the carried arrays at
each row's slot and save row (`scatter`), in place. A layer without states (full attention) returns
its start rows unchanged, and its state row is out of range, so its scatter drops.

The rows of a step are its runs of equal `segment` (batch.py packs each row's tokens contiguously, in
position order, padding after the last), numbered in order from 0 (`token_rows`); R, static, bounds
them (Buckets.rows: min(tokens, max rows)). A row past R can only be padding: it reads zeros and
writes nothing.

Shapes in the legend of worker_svc/__init__.py; here R the step's rows, L' the linear layers.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from worker_svc.layers.paged import PagedContext


class TokenRows(NamedTuple):
    """Per token [T]: its row's number in the step, its row's first token, whether it is its row's last."""

    row: jax.Array
    first: jax.Array
    last: jax.Array


class StepRows(NamedTuple):
    """Per row [R]: where its states start (`source`: its slot, or a prefix cache snapshot:
    PagedContext.state_from), whether it starts from zeros (`fresh`: at position 0, or without a
    slot), and the rows its end states go to (`slot`, and `save`: a snapshot PagedContext.state_save
    names); `slots` (B + S, out of range) for none."""

    source: jax.Array
    fresh: jax.Array
    slot: jax.Array
    save: jax.Array


def token_rows(segment: jax.Array) -> TokenRows:
    """segment [T] (PagedContext's) -> each token's row in the step, numbered from 0 in order."""
    index = jnp.arange(segment.shape[0])
    starts = jnp.concatenate([jnp.ones((1,), bool), segment[1:] != segment[:-1]])
    last = jnp.concatenate([segment[1:] != segment[:-1], jnp.ones((1,), bool)])
    return TokenRows(jnp.cumsum(starts) - 1, jax.lax.cummax(jnp.where(starts, index, 0)), last)


def step_rows(ctx: PagedContext, rows: int, slots: int) -> StepRows:
    """The step's `rows` rows (R, static) over state arrays of `slots` rows (B + S), read at each
    row's first token (its source) and last (its save: a chunk saves at its row's end alone). No
    slots at all: one row, as every row starts from zeros (a row past R reads them too) and none
    is written."""
    tokens, rows = token_rows(ctx.segment), rows if slots else 1
    at = lambda which: jnp.zeros((rows,), jnp.int32).at[jnp.where(which, tokens.row, rows)].set(
        jnp.arange(ctx.segment.shape[0], dtype=jnp.int32), mode="drop")
    first, last = at(tokens.first == jnp.arange(ctx.segment.shape[0])), at(tokens.last)
    present = jnp.arange(rows) <= tokens.row[-1]  # a row number past the step's last row: none
    slot = jnp.where(present & (ctx.state_slot[first] >= 0), ctx.state_slot[first], slots)
    fresh = (ctx.positions[first] == 0) | (slot == slots)
    if ctx.state_from is None:  # a context built without snapshots
        return StepRows(slot, fresh, slot, jnp.full_like(slot, slots))
    source = jnp.where(ctx.state_from[first] >= 0, ctx.state_from[first], slot)
    save = jnp.where((slot < slots) & (ctx.state_save[last] >= 0), ctx.state_save[last], slots)
    return StepRows(source, fresh, slot, save)


def gather(states: tuple[jax.Array, ...], layer_row: jax.Array, rows: StepRows) -> tuple[jax.Array, ...]:
    """Each state array [L', B + S, ...] -> its start rows [R, ...] for the layer at `layer_row`
    (L' or more for a layer without states: zeros), zeros for a fresh row; with no slots at all (a
    forward over whole sequences keeping no state, as a trainer's or a test's) zeros."""
    def start(array):
        if array.shape[1] == 0:
            return jnp.zeros((rows.source.shape[0], *array.shape[2:]), array.dtype)
        read = array.at[layer_row, rows.source].get(mode="fill", fill_value=0)
        return jnp.where(rows.fresh.reshape(-1, *(1,) * (array.ndim - 2)), 0, read)
    return tuple(start(a) for a in states)


def scatter(states: tuple[jax.Array, ...], layer_row: jax.Array, rows: StepRows, ends: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Each state array with its end rows [R, ...] written at [`layer_row`, each row's slot] and
    [`layer_row`, each row's save], dropped out of range (a layer without states, a row without a
    slot or a save; no slots at all: nothing written). In place: the carry is not read after."""
    def write(array, end):
        if array.shape[1] == 0:
            return array
        array = array.at[layer_row, rows.slot].set(end.astype(array.dtype), mode="drop")
        return array.at[layer_row, rows.save].set(end.astype(array.dtype), mode="drop")
    return tuple(write(a, e) for a, e in zip(states, ends))
