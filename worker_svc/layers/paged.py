"""The paged KV cache as attention reads it, and a step's context over it: where each token sits
and which cached pages it reads (layers/attention.py, layers/ordered_attention.py).

What a token's cache entry is depends on the model's attention (`CacheSpec`, chosen by the model
file: `Decoder.cache_spec`): standard attention keeps its keys and values per KV head, "k" and
"v" [K, H] each; multi-head latent attention (layers/mla.py) one latent vector shared by every
head, "k" alone [1, R + Dr]. The engine allocates each array [L, P, Z, *per token] from the spec;
pages, the scheduler's accounting and the prefix cache are the same for either kind. L is every
layer, or for a hybrid only the layers that attend over pages (`paged_layers`: its full-attention
ones), each reading its own row (`rows_among`).

Linear attention (Gated DeltaNet, layers/delta_net.py) keeps no entry per token but a fixed-size
state per request: its spec's `states` name arrays of one row per request slot (worker_svc/slots.py:
the scheduler's max running requests) and then one per prefix-cache snapshot (scheduler.state_snapshots:
a prefix's state kept at a cache node, scheduler_svc/snapshots.py; PagedContext.state_from and
state_save), [L', B + S, *per slot] over the model's L' linear layers, held in
float32 (`STATE_DTYPE`: the recurrence accumulates over the whole context). A step reads and writes
each token's row's slot (PagedContext.state_slot); a row at position 0 starts from zeros, so a
(re)admitted request needs no clearing and a slot's old contents are never read.

What the cache holds (worker.kv_cache_dtype, `storage_dtype`): the model dtype, or under float32
weights bfloat16's bits, widened to float32 where a page is read (`from_cache`); either way a step
attends its own keys and values as the cache will hold them (`as_cached`).

Shapes in the legend of worker_svc/__init__.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from worker_svc.layers import abstract


class PagedContext(NamedTuple):
    """Where each token of a step sits and which cached pages it reads."""

    positions: jax.Array  # [T] i32
    segment: jax.Array  # [T] i32: the step row of each token; -1 for padding
    pair_token: jax.Array  # [W] i32: the query token of each pair; T for padding
    pair_page: jax.Array  # [W] i32: the cache page the pair reads
    pair_start: jax.Array  # [W] i32: position held by the page's first slot
    pair_limit: jax.Array  # [W] i32: the row's positions below this are in the cache
    pages: jax.Array  # [T, O] i32: each token's row's cached pages, in order; 0 past them
    cached: jax.Array  # [T] i32: the row's positions below this are in the cache (its pages' cover)
    # [T] i32: the request slot of each token's row, whose recurrent state a linear layer reads and
    # writes (CacheSpec.states); -1 for padding and for a seq without a slot (its state is not kept)
    state_slot: Any = None
    # The adapters' slot arrays and each token's slot (layers/lora.py's LoraStep), where the worker
    # serves adapters; None (an empty pytree: nothing traced) where it does not. Here because the
    # context is what reaches every layer's projections.
    lora: Any = None
    # [T] i32, beside state_slot (the prefix cache's state snapshots, rows past the request slots):
    # the row a token's row starts its states from when not its slot (a snapshot its request's
    # prefix hit ends at), and a second row its row's last token saves its states into (a snapshot
    # the cache keeps); -1: none (state_from: its slot).
    state_from: Any = None
    state_save: Any = None

    @classmethod
    def padded(cls, tokens: int, pairs: int, page_list: int = 0, full: Callable = np.full) -> PagedContext:
        """Every token and pair padding: no row, no page read (layers/abstract.py). A step reads
        its cache through `pairs` or through `page_list` columns, the other 0."""
        return cls(positions=full(tokens, 0, np.int32), segment=full(tokens, -1, np.int32), pair_token=full(pairs, tokens, np.int32),
                   pair_page=full(pairs, 0, np.int32), pair_start=full(pairs, 0, np.int32), pair_limit=full(pairs, 0, np.int32),
                   pages=full((tokens, page_list), 0, np.int32), cached=full(tokens, 0, np.int32),
                   state_slot=full(tokens, -1, np.int32), state_from=full(tokens, -1, np.int32), state_save=full(tokens, -1, np.int32))

    @classmethod
    def shapes(cls, tokens: int, pairs: int, page_list: int = 0) -> PagedContext:
        return cls.padded(tokens, pairs, page_list, abstract.full)

    @classmethod
    def sequence(cls, length: int, page_size: int) -> PagedContext:
        """One row of `length` tokens at positions 0.. as one step, nothing cached, with the pairs
        `ordered_attention` reads (every page up to each token's own): how a trainer runs the
        served layers over a whole sequence and gets batch_invariant's numbers."""
        positions = np.arange(length, dtype=np.int32)
        pages, page = pages_up_to(positions, page_size)
        return cls(positions=positions, segment=np.zeros(length, np.int32), pair_token=np.repeat(positions, pages),
                   pair_page=page, pair_start=page * page_size, pair_limit=np.zeros(len(page), np.int32),
                   pages=np.zeros((length, 0), np.int32), cached=np.zeros(length, np.int32),
                   state_slot=np.full(length, -1, np.int32), state_from=np.full(length, -1, np.int32),
                   state_save=np.full(length, -1, np.int32))


def pages_up_to(positions: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The pages `ordered_attention` reads for tokens of one row at `positions` [T]: every page up
    to the token's own. Returns the count per token [T] and, token after token, each pair's page
    index in the row [sum of the counts]."""
    pages = positions // page_size + 1
    return pages, np.arange(pages.sum(), dtype=np.int32) - np.repeat(np.cumsum(pages) - pages, pages)


class KVCache(NamedTuple):
    """The arrays a CacheSpec names, by name; an array the spec lacks is None (an empty pytree
    node: jit, donation and tree maps pass it through). The paged ones first, then the per-slot states."""

    k: jax.Array  # [L, P, Z, K, H] (standard) or [L, P, Z, 1, R + Dr] (latent), in the storage dtype (`storage_dtype`)
    v: jax.Array | None = None  # [L, P, Z, K, H]; None for a latent cache
    conv: jax.Array | None = None  # [L', B, W - 1, Nk, G] f32: each linear layer's last W - 1 convolution inputs per slot
    state: jax.Array | None = None  # [L', B, N, Dk, Dv] f32: each linear layer's recurrent matrix per slot

    @property
    def states(self) -> tuple:
        """The per-slot arrays (None where the model has none)."""
        return self.conv, self.state


PAGED = ("k", "v")  # KVCache's paged fields; the rest are per slot
STATE_DTYPE = jnp.float32


@dataclass(frozen=True)
class PagedArray:
    """One paged array of a cache: its KVCache field, the shape of one token's entry, and the
    logical sharding names of that entry's axes (sharding.py; the leading [L, P, Z] are CACHE_AXES)."""

    name: str  # "k" or "v"
    per_token: tuple[int, ...]
    names: tuple[str | None, ...]


@dataclass(frozen=True)
class StateArray:
    """One per-request array of a cache: its KVCache field ("conv" or "state"), the layers holding
    it (the linear ones), the shape of one slot's entry in one layer, and the logical sharding names
    of that entry's axes (sharding.py; the leading [L', B] are never split; none: replicated)."""

    name: str
    layers: int
    per_slot: tuple[int, ...]
    names: tuple[str | None, ...] = ()


@dataclass(frozen=True)
class CacheSpec:
    """The layout of a model's cache: its paged arrays and its per-request states (linear
    attention's; none for other models). Static and hashable."""

    paged: tuple[PagedArray, ...]
    states: tuple[StateArray, ...] = ()
    # The layers whose attention reads and writes pages, in order: row i of each paged array is
    # layer paged_layers[i]'s. None: every layer, row i layer i (every model without linear layers).
    paged_layers: tuple[int, ...] | None = None

    @classmethod
    def standard(cls, kv_heads: int, head_dim: int) -> CacheSpec:
        """Keys and values per KV head, [K, H] each, split over tensor-parallel devices by KV head."""
        return cls(tuple(PagedArray(name, (kv_heads, head_dim), ("kv_heads", "head_dim")) for name in ("k", "v")))

    @classmethod
    def latent(cls, width: int) -> CacheSpec:
        """One latent vector per token, shared by every head ([1, width]): replicated, as every
        head's device reads all of it."""
        return cls((PagedArray("k", (1, width), (None, None)),))

    @property
    def per_head(self) -> bool:
        """Whether this is the standard layout, keys and values per KV head (what the CPU attention kernel reads)."""
        return tuple(a.name for a in self.paged) == ("k", "v") and all(a.names == ("kv_heads", "head_dim") for a in self.paged)

    def rows(self, layers: int) -> int:
        """The paged arrays' rows (their leading L) for a model of `layers` layers: those holding pages."""
        return layers if self.paged_layers is None else len(self.paged_layers)

    def bytes_per_token(self, layers: int, dtype) -> int:
        """The cache's bytes per token: the layers holding pages x the entries' numbers x the storage dtype's size."""
        return self.rows(layers) * sum(math.prod(a.per_token) for a in self.paged) * jnp.dtype(dtype).itemsize

    def with_states(self, *states: StateArray, paged_layers: tuple[int, ...] | None = None) -> CacheSpec:
        """This spec with per-request states, and pages for `paged_layers` alone (None: every layer)."""
        return CacheSpec(self.paged, self.states + states, paged_layers)

    def state_rows(self, layers: int) -> tuple[int, ...]:
        """Per layer of `layers`, its row in the per-slot state arrays (-1 for a layer without): a
        model with states keeps them in the layers holding no pages (a hybrid's linear ones), in order."""
        if not self.states:
            return (-1,) * layers
        return rows_among(tuple(self.paged_layers is not None and i not in self.paged_layers for i in range(layers)))

    def state_bytes_per_slot(self) -> int:
        """One request slot's bytes over every per-request array (0 without any)."""
        return sum(a.layers * math.prod(a.per_slot) for a in self.states) * jnp.dtype(STATE_DTYPE).itemsize

    def shapes(self, layers: int, num_pages: int, page_size: int, slots: int = 0) -> dict[str, tuple[int, ...]]:
        """Each array's shape by name: a paged one's [L, P, Z, *per token] (L the layers holding pages:
        `rows`), a state's [L', slots, *per slot]."""
        return {a.name: (self.rows(layers), num_pages, page_size, *a.per_token) for a in self.paged} | {
            a.name: (a.layers, slots, *a.per_slot) for a in self.states}

    def cache(self, arrays: dict[str, object]) -> KVCache:
        """A KVCache of `arrays` by name (arrays, shapes or shardings), None where the spec has none."""
        return KVCache(**{a.name: arrays[a.name] for a in (*self.paged, *self.states)})


def rows_among(chosen: tuple[bool, ...]) -> tuple[int, ...]:
    """Per layer, its row among the `chosen` layers (-1 for one not chosen): a full-attention layer's
    row of the paged arrays, a linear layer's of the states."""
    return tuple(sum(chosen[:i]) if held else -1 for i, held in enumerate(chosen))


BF16_BITS = jnp.uint16  # a bfloat16 cache's storage under float32 arithmetic: bfloat16's bits


def storage_dtype(model_dtype, kv_cache_dtype: str):
    """The dtype a KV cache holds for worker.kv_cache_dtype: "auto", the model's; "bfloat16",
    bfloat16 (half float32's bytes), held as its bits in uint16 when the model computes in float32.
    Read, the bits widen to float32 by a shift and a bitcast, exactly; XLA:CPU's own bfloat16 to
    float32 convert ran ~10x slower than reading the float32 cache (docs/journal.md,
    "A bfloat16 KV cache")."""
    if kv_cache_dtype == "auto" or jnp.dtype(model_dtype) == jnp.bfloat16:
        return jnp.dtype(model_dtype)
    return jnp.dtype(BF16_BITS)


def to_cache(x: jax.Array, storage) -> jax.Array:
    """Keys or values as a cache of `storage` dtype holds them (bfloat16 bits: rounded to nearest)."""
    if jnp.dtype(storage) == BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), BF16_BITS)
    return x.astype(storage)


def from_cache(x: jax.Array) -> jax.Array:
    """What the cache holds, as attention reads it: bfloat16 bits widened to float32, else x."""
    if x.dtype == BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.uint32) << 16, jnp.float32)
    return x


def as_cached(x: jax.Array, storage) -> jax.Array:
    """This step's keys or values as attention reads them back from a cache of `storage` dtype, so
    a key counts the same whichever step wrote it (a no-op for a cache of x's dtype)."""
    return from_cache(to_cache(x, storage))
