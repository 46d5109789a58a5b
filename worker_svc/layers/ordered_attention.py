"""`ordered_attention` (worker.batch_invariant): attention whose every sum runs in an order fixed by
the token's own context. One source, every page a token sees, cached or filled this step, each
summed on its own and added to the token's totals in position order; the order of every sum is the
token's own, whatever shares the step or came before it.

The per-model terms (scale, soft-capping, sliding window, sinks: softmax_state.py) apply as in
paged_attention. A windowed layer reads the same pairs as a full one (the pairs list is the step's,
every layer's) and masks the positions below its window.

Shapes in the legend of worker_svc/__init__.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from worker_svc.layers.paged import KVCache, PagedContext, as_cached, from_cache
from worker_svc.layers.softmax_state import NEG_INF, capped, in_window

PAIR_CHUNK = 128  # C: pairs attended per loop iteration


def ordered_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, layer: jax.Array, ctx: PagedContext,
                      every_chunk: bool = False, *, scale: float | None = None, softcap: float | None = None,
                      window: jax.Array | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """batch_invariant's attention: q [T, N, H], this step's k and v [T, K, H] -> [T, N, H].
    `scale` (None: H**-0.5), `softcap`, `window` (the layer's, traced; None: full) and `sinks` [N]:
    softmax_state.py's terms.

    The pairs (batch.py, `every_page`) list every page of a token's row up to its own position, the
    token's pages in order; a slot at or past the pair's limit is this step's, read from k and v
    (the step writes them into the cache after every layer). Two passes over the pairs: the max of
    each token's scores (exact in any order), then each pair's page sums of exp(score - max) and
    of the weighted values, added into the token's totals one pair at a time in pair order (a
    scatter-add applies its updates in order). So a token's result depends on its own context
    alone: not on the step's other tokens, the chunk a pair falls in, or which of its keys an
    earlier step wrote. A sink joins the max before the sums and its exp(sink - max) the total
    last. A trainer gets the same bits by calling this with a whole sequence as one step (an empty
    cache, every key this step's), with `every_chunk` (a loop of static length, which reverse-mode
    differentiation needs) instead of the real chunks only."""
    num_tokens, heads, head_dim = q.shape
    kv_heads, page_size = k.shape[1], cache.k.shape[2]
    if ctx.pair_page.shape[0] == 0:  # a pairs bucket of 0 (compiled, never fit: every token reads its own page)
        return jnp.zeros_like(q)
    q = q.reshape(num_tokens, kv_heads, heads // kv_heads, head_dim) * (head_dim**-0.5 if scale is None else scale)  # [T, K, G, H]
    k, v = as_cached(k, cache.k.dtype), as_cached(v, cache.v.dtype)
    extra = -ctx.pair_page.shape[0] % PAIR_CHUNK  # whole chunks of PAIR_CHUNK: one shape for every einsum
    pairs = (ctx.pair_token, ctx.pair_page, ctx.pair_start, ctx.pair_limit)
    pairs = [jnp.pad(a, (0, extra), constant_values=fill).reshape(-1, PAIR_CHUNK) for a, fill in zip(pairs, (num_tokens, 0, 0, 0))]

    def scores(i):
        token, page, start, limit = (a[i] for a in pairs)
        position = start[:, None] + jnp.arange(page_size)[None, :]  # [C, Z]
        own = jnp.take(ctx.positions, token, mode="fill", fill_value=-1)  # [C]; padding pairs see nothing
        fresh = (position >= limit[:, None])[..., None, None]  # [C, Z, 1, 1]: filled by this step
        at = jnp.clip(token[:, None] + position - own[:, None], 0, num_tokens - 1)  # [C, Z]: the step's token there
        keys = jnp.where(fresh, jnp.take(k, at, axis=0), from_cache(cache.k[layer, page]))  # [C, Z, K, H]
        values = jnp.where(fresh, jnp.take(v, at, axis=0), from_cache(cache.v[layer, page]))
        q_pair = jnp.take(q, token, axis=0, mode="fill", fill_value=0)  # [C, K, G, H]
        s = capped(jnp.einsum("CKGH,CZKH->CKGZ", q_pair, keys, preferred_element_type=jnp.float32), softcap)
        visible = (position <= own[:, None]) & in_window(position, own[:, None], window)  # [C, Z]
        return token, jnp.where(visible[:, None, None, :], s, NEG_INF), values

    def peak(i, top):
        token, s, _ = scores(i)
        return top.at[token].max(s.max(-1), mode="drop")

    def absorb(i, state):
        total, out = state
        token, s, values = scores(i)
        p = jnp.exp(s - jnp.take(top, token, axis=0, mode="fill", fill_value=0)[..., None])  # [C, K, G, Z]
        weighted = jnp.einsum("CKGZ,CZKH->CKGH", p.astype(values.dtype), values, preferred_element_type=jnp.float32)
        return total.at[token].add(p.sum(-1), mode="drop"), out.at[token].add(weighted, mode="drop")

    chunks = pairs[0].shape[0] if every_chunk else (jnp.sum(ctx.pair_token < num_tokens) + PAIR_CHUNK - 1) // PAIR_CHUNK
    state = q.shape[:3]  # [T, K, G]
    sink = None if sinks is None else jnp.broadcast_to(sinks.astype(jnp.float32).reshape(kv_heads, -1), state)
    top = jax.lax.stop_gradient(jax.lax.fori_loop(0, chunks, peak, jnp.full(state, NEG_INF, jnp.float32) if sink is None else sink))
    total, out = jax.lax.fori_loop(0, chunks, absorb, (jnp.zeros(state, jnp.float32), jnp.zeros((*state, head_dim), jnp.float32)))
    if sink is not None:
        total = total + jnp.exp(sink - top)
    out = jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)  # padding tokens: 0
    return out.reshape(num_tokens, heads, head_dim).astype(q.dtype)
