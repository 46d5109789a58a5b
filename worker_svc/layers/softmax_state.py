"""What every way of attending shares (layers/attention.py, layers/ordered_attention.py): a
running (online) softmax's state, and the per-model terms of a score beyond the dot product.

A state is (max [T, K, G], sum of exp(score - max) [T, K, G], sum of the values weighted by it
[T, K, G, H]), in float32, of queries over some keys; states over disjoint keys combine exactly
(`combined`), so each source of keys (this step's own, the cache's pages) is folded in on its own.

The per-model terms, in the order they apply (transformers' eager attention):
- the query scale (Attention's `scale`: head_dim**-0.5, or Gemma's query_pre_attn_scalar**-0.5);
- soft-capping (Gemma 2): each score s -> cap * tanh(s / cap), before any mask (`capped`);
- the sliding window: a key at position q is visible to a query at position p iff q <= p and
  (w == 0 or q > p - w), w the layer's window, traced (`in_window`);
- sinks (GPT-OSS): a learned logit per query head that joins each softmax's denominator and adds
  no value (`with_sinks`): the final state with one more "key" of score `sink` and value 0.

Shapes in the legend of worker_svc/__init__.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so a fully masked source adds exp(-inf - m) = 0 rather than NaN

# The running softmax state of queries over some keys: max [T, K, G], sum [T, K, G], weighted values [T, K, G, H]
State = tuple[jax.Array, jax.Array, jax.Array]


def capped(scores: jax.Array, softcap: float | None) -> jax.Array:
    """float32 scores, soft-capped to (-softcap, softcap) where the model caps them (Gemma 2)."""
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def in_window(key: jax.Array, query: jax.Array, window: jax.Array | None) -> jax.Array | bool:
    """Whether keys at positions `key` lie in the window of queries at positions `query` (broadcast
    together): q > p - w, or every key where the layer's window w is 0 (full attention) or None
    (the model's layers are all full). Causality (q <= p) is each caller's own mask."""
    if window is None:
        return True
    return (window <= 0) | (key > query - window)


def lowest_visible(positions: jax.Array, window: jax.Array | None) -> jax.Array | int:
    """The lowest position a query at each of `positions` sees: p - w + 1, or 0 (full attention)."""
    if window is None:
        return 0
    return jnp.where(window > 0, jnp.maximum(positions - window + 1, 0), 0)


def combined(a: State, b: State) -> State:
    """One running softmax state from two over disjoint keys."""
    top = jnp.maximum(a[0], b[0])
    scale_a, scale_b = jnp.exp(a[0] - top), jnp.exp(b[0] - top)
    return top, a[1] * scale_a + b[1] * scale_b, a[2] * scale_a[..., None] + b[2] * scale_b[..., None]


def fold(state: State, scores: jax.Array, values: jax.Array, spec: str) -> State:
    """A running softmax state with one more block of scores [T, K, G, S] and its values (`spec`:
    the einsum of the probabilities and values to [T, K, G, H])."""
    top, total, out = state
    new_top = jnp.maximum(top, scores.max(-1))
    rescale = jnp.exp(top - new_top)
    p = jnp.exp(scores - new_top[..., None])
    weighted = jnp.einsum(spec, p.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return new_top, total * rescale + p.sum(-1), out * rescale[..., None] + weighted


def with_sinks(state: State, sinks: jax.Array | None) -> State:
    """The state with each query head's sink logit (sinks [K, G]) in its denominator: a key of
    score `sink` whose value is 0. None: the state as it is."""
    if sinks is None:
        return state
    sink = jnp.broadcast_to(sinks.astype(jnp.float32), state[0].shape)
    return combined(state, (sink, jnp.ones_like(sink), jnp.zeros_like(state[2])))
