"""The seam between the layers and a platform's kernels: what a layer may ask of them.

The layers run in jax.numpy everywhere. Where a platform has faster kernels (XLA:CPU's of our own,
worker_svc/cpu_kernels/; JAX's Pallas kernels, worker_svc/pallas_kernels/), start-up builds them
and hands the model one `Kernels` value in its `Numerics` (worker_svc/start.py's `numerics`); the layers and the engine reach them only through
it, never by importing a kernel module, and run their own way wherever it answers None (or False).
Numerics never hands the kernels a step under batch_invariant, whose fixed orders are XLA's.

A Kernels value is part of the model's static configuration (Numerics is a static attribute of
every layer, and a static argument of the compiled steps): it must be immutable, hashable and
compare by value, as a frozen dataclass does.

Shapes in the legend of worker_svc/__init__.py.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from worker_svc.layers.softmax_state import State


class Kernels(Protocol):
    def product(self, spec: str, x: jax.Array, w: Any, row: jax.Array | None = None, **kwargs: Any) -> jax.Array | None:
        """jnp.einsum(spec, x, w, **kwargs) for x [T, I] float32 and a float32 weight or an int8 QArray
        (layers/quantized.py), or None where the kernel does not take it. With `row` (a traced layer
        index), w's arrays are a stack [L, ...] and the product is with its layer `row`, read where it
        lies (layers/stack_layer.py)."""

    def reads_stacked_whole(self, rows: int) -> bool:
        """Whether a step of `rows` rows hands the layer scan's matmul weights whole, each with its
        layer row, for `product` to read in place (layers/decoder.py), rather than scanning them."""

    def attends(self, q_dtype: Any, cache_dtype: Any, group: int, head_dim: int) -> bool:
        """Whether `cached_state` reads a cache of `cache_dtype` for queries of `q_dtype`, `group`
        query heads per key head and head dimension `head_dim` (the engine reads every step's cache
        through page lists where it does: batch.py's `Buckets.choose_page_lists`)."""

    def cached_state(self, q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, layer: jax.Array, pages: jax.Array,
                     cached: jax.Array, lowest: jax.Array | None = None, softcap: float | None = None) -> State | None:
        """The State of queries q [T, K, G, H] (scaled) over each token's cached positions: its row's
        from lowest[t] (a sliding window's first; None: 0) below cached[t], in pages pages[t] of the
        cache [L, P, Z, K, H] at `layer`, each score soft-capped by `softcap` where given
        (layers/softmax_state.py); None where the kernel does not apply (layers/attention.py's
        page-list loop runs)."""

    def grouped_product(self, rows: jax.Array, w: Any, group_sizes: jax.Array, row_group: jax.Array) -> jax.Array | None:
        """jax.lax.ragged_dot(rows [X, A], w [E, A, B], group_sizes [E]) -> [X, B] (MoE's grouped
        matmul, rows sorted by expert, `row_group` [X] each row's; a row past every group is 0), or
        None where the kernel does not take it (layers/quantized.py's ragged_dot runs)."""

    def own_state(self, q: jax.Array, k: jax.Array, v: jax.Array, segment: jax.Array, window: jax.Array | None = None,
                  softcap: float | None = None) -> State | None:
        """The State of queries q [T, K, G, H] (scaled) over this step's own keys and values k, v
        [T, K, H], each token's over its row's tokens (`segment` [T], -1 for padding) up to its own
        and within its sliding `window` (the layer's, traced; None: full), scores soft-capped by
        `softcap`; None where the kernel does not apply."""
