"""Grouped-query attention over the paged KV cache, in pure jax.numpy (the `native` backend).

`paged_attention`: a step's queries attend two sources, combined in one softmax:

- the cache: what earlier steps wrote, read one of two ways, whichever the step's shape compiled
  (batch.py's Buckets chooses by its token count):
  - page lists (decode and short chunks): each token lists its row's cached pages in order, and a
    loop gathers a chunk of every token's pages at a time and attends them batched over the
    tokens, as many iterations as the step's longest context needs;
  - (token, page) pairs (prefill chunks): the work list holds one pair per cached page of each
    token's row, consumed PAIR_CHUNK pairs at a time, so a long chunk over a long context costs
    what its pairs cost, bucketed, whatever mix of rows shares the step.
  Either way a running (online) softmax carries each token's state from one chunk to the next.
  Where the model's kernels attend (Numerics.kernels, kernels.py; on XLA:CPU), page lists are
  read by a kernel instead, which returns the same state over the cache, and the engine then reads
  every step's cache through page lists (batch.py's `Buckets.choose_page_lists`);
- this step's own keys and values (causal within the row), which the step writes into the cache
  only after every layer has read it. Reading and writing the cache in the same layer would make
  XLA copy the whole cache to keep the read consistent. The kernels attend them too (`own_state`):
  each token its own row's keys alone, where the tiles below score whole tiles of other rows and
  later positions only to mask them.

What the cache holds (worker.kv_cache_dtype, `storage_dtype`): the model dtype, or under float32
weights bfloat16's bits, widened to float32 where a page is read (`from_cache`); either way a step
attends its own keys and values as the cache will hold them.

`ordered_attention` (worker.batch_invariant): one source, every page a token sees, cached or
filled this step, each summed on its own and added to the token's totals in position order; the
order of every sum is the token's own, whatever shares the step or came before it.

Shapes in the legend of worker_svc/__init__.py.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from worker_svc.layers import abstract
from worker_svc.layers.kernels import Kernels
from worker_svc.layers.norms import RMSNorm
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.quantized import weight
from worker_svc.layers.rotary import Rope

PAIR_CHUNK = 128  # C: pairs attended per inner-loop iteration
OWN_TILE = 128  # tokens per tile when a step's tokens attend each other by tiles
OWN_DENSE_TOKENS = 256  # steps of up to this many tokens attend each other densely, T x T
LIST_CHUNK_PAGES = 128  # pages the page-list loop gathers per iteration, at most, over all of a step's tokens
NEG_INF = -1e30  # finite, so a fully masked source adds exp(-inf - m) = 0 rather than NaN


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

    @classmethod
    def padded(cls, tokens: int, pairs: int, page_list: int = 0, full: Callable = np.full) -> PagedContext:
        """Every token and pair padding: no row, no page read (layers/abstract.py). A step reads
        its cache through `pairs` or through `page_list` columns, the other 0."""
        return cls(positions=full(tokens, 0, np.int32), segment=full(tokens, -1, np.int32), pair_token=full(pairs, tokens, np.int32),
                   pair_page=full(pairs, 0, np.int32), pair_start=full(pairs, 0, np.int32), pair_limit=full(pairs, 0, np.int32),
                   pages=full((tokens, page_list), 0, np.int32), cached=full(tokens, 0, np.int32))

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
                   pages=np.zeros((length, 0), np.int32), cached=np.zeros(length, np.int32))


def pages_up_to(positions: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The pages `ordered_attention` reads for tokens of one row at `positions` [T]: every page up
    to the token's own. Returns the count per token [T] and, token after token, each pair's page
    index in the row [sum of the counts]."""
    pages = positions // page_size + 1
    return pages, np.arange(pages.sum(), dtype=np.int32) - np.repeat(np.cumsum(pages) - pages, pages)


class KVCache(NamedTuple):
    k: jax.Array  # [L, P, Z, K, H], in the storage dtype (`storage_dtype`)
    v: jax.Array  # [L, P, Z, K, H]


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


class Attention(nnx.Module):
    """`qk_norm_eps` given (Qwen3): an RMSNorm over each head's dimensions on q and k, before rotary.
    `qkv_bias` (Qwen2): a bias added to each head's q, k and v (never quantized: it is not a matmul's)."""

    IN_PLACE = ("q", "k", "v", "o")  # in a step of few rows, read in place in their stack by a kernel (stack_layer.py)

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, *, qk_norm_eps: float | None = None,
                 qkv_bias: bool = False, numerics: Numerics = Numerics(), dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.numerics = numerics
        int8, std = numerics.quantization, dim**-0.5
        self.q = weight(rngs, (dim, heads, head_dim), std, ("embed", "heads", "head_dim"), (0,), dtype, int8)  # [D, N, H]
        self.k = weight(rngs, (dim, kv_heads, head_dim), std, ("embed", "kv_heads", "head_dim"), (0,), dtype, int8)  # [D, K, H]
        self.v = weight(rngs, (dim, kv_heads, head_dim), std, ("embed", "kv_heads", "head_dim"), (0,), dtype, int8)  # [D, K, H]
        self.o = weight(rngs, (heads, head_dim, dim), (heads * head_dim)**-0.5, ("heads", "head_dim", "embed"), (0, 1), dtype,
                        int8)  # [N, H, D]
        with_norm = qk_norm_eps is not None
        self.q_norm = RMSNorm(head_dim, qk_norm_eps, numerics=numerics, dtype=dtype) if with_norm else None  # scale [H], shared by the heads
        self.k_norm = RMSNorm(head_dim, qk_norm_eps, numerics=numerics, dtype=dtype) if with_norm else None
        # Random stand-ins as the weights' (loading.py fills them), so a model built without a checkpoint adds them too.
        self.q_bias = _bias(rngs, (heads, head_dim), ("heads", "head_dim"), dtype) if qkv_bias else None  # [N, H]
        self.k_bias = _bias(rngs, (kv_heads, head_dim), ("kv_heads", "head_dim"), dtype) if qkv_bias else None  # [K, H]
        self.v_bias = _bias(rngs, (kv_heads, head_dim), ("kv_heads", "head_dim"), dtype) if qkv_bias else None  # [K, H]

    def __call__(
        self, x: jax.Array, rope: Rope, cache: KVCache, layer: jax.Array, ctx: PagedContext
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [T, D] -> (output [T, D], this step's keys [T, K, H] and values [T, K, H] to write)."""
        matmul = self.numerics.matmul
        q = matmul("TD,DNH->TNH", x, self.q[...])
        k = matmul("TD,DKH->TKH", x, self.k[...])
        v = matmul("TD,DKH->TKH", x, self.v[...])
        if self.q_bias is not None:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q), rope(k)
        if self.numerics.batch_invariant:
            out = ordered_attention(q, k, v, cache, layer, ctx)
        else:
            out = paged_attention(q, k, v, cache, layer, ctx, kernels=self.numerics.kernels)
        return matmul("TNH,NHD->TD", out, self.o[...]), k, v


def _bias(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], dtype: jnp.dtype) -> nnx.Param:
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype), out_sharding=names, eager_sharding=False)


def paged_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, layer: jax.Array, ctx: PagedContext,
    kernels: Kernels | None = None
) -> jax.Array:
    """q [T, N, H], this step's k and v [T, K, H] -> [T, N, H]. Softmax in float32. `kernels`
    (Numerics.kernels): the step's own keys and the page lists attended by them where they apply."""
    num_tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(num_tokens, kv_heads, heads // kv_heads, head_dim) * head_dim**-0.5  # [T, K, G, H]
    k, v = as_cached(k, cache.k.dtype), as_cached(v, cache.v.dtype)

    # Running softmax state per token, started from this step's own keys: max, sum, weighted values.
    own = None if kernels is None else kernels.own_state(q, k, v, ctx.segment)
    if own is None:
        tiles = num_tokens > OWN_DENSE_TOKENS and num_tokens % OWN_TILE == 0
        own = (_attend_own_tiles if tiles else _attend_own)(q, k, v, ctx.segment, ctx.positions)
    top, total, out = own

    if ctx.pages.shape[1]:  # the shape's layout (batch.py): page lists, pairs, or neither (no cached context)
        cached = None if kernels is None else kernels.cached_state(q, cache.k, cache.v, layer, ctx.pages, ctx.cached)
        if cached is None:
            top, total, out = _attend_page_lists(q, cache, layer, ctx, (top, total, out))
        else:
            top, total, out = _combined((top, total, out), cached)
    elif ctx.pair_page.shape[0]:
        top, total, out = _attend_pairs(q, cache, layer, ctx, (top, total, out))
    return (out / total[..., None]).reshape(num_tokens, heads, head_dim).astype(q.dtype)


def _attend_own(q, k, v, segment, positions):
    """The (max, sum, weighted values) state [T, K, G], [T, K, G], [T, K, G, H] of queries q [T, K, G, H]
    over keys and values [U, K, H] of their own row (`segment`), not later in it (`positions`).
    Padding tokens (row -1) see each other only, so every state is finite."""
    scores = _own_scores(q, k, segment, segment, positions, positions)
    top = scores.max(-1)
    p = jnp.exp(scores - top[..., None])
    return top, p.sum(-1), jnp.einsum("TKGU,UKH->TKGH", p.astype(v.dtype), v, preferred_element_type=jnp.float32)


def _attend_own_tiles(q, k, v, segment, positions):
    """_attend_own block by block: queries in tiles of OWN_TILE tokens, each attending only the key
    tiles from the one where its first token's row starts up to its own (a while loop, running
    softmax). A step lays each row's tokens out contiguously in position order (batch.py), so a
    query never sees a later tile, nor one before its rows began: a step packing many short
    prompts costs their own blocks, not T x T, and one long prompt about half. Scores stay in a
    [OWN_TILE, K, G, OWN_TILE] block that fits the CPU's cache, where [T, K, G, T] did not."""
    num_tokens, tile = q.shape[0], OWN_TILE
    tiles = num_tokens // tile
    q, k, v, rows, spots = (a.reshape(tiles, tile, *a.shape[1:]) for a in (q, k, v, segment, positions))

    def query_tile(i):
        first = jnp.argmax(segment == rows[i, 0]) // tile  # the tile where the tile's first row starts

        def absorb(j, state):
            scores = _own_scores(q[i], k[j], rows[i], rows[j], spots[i], spots[j])
            return _fold(state, scores, v[j], "TKGU,UKH->TKGH")

        shape = q.shape[1:4]  # [tile, K, G]
        start = (jnp.full(shape, NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros((*shape, q.shape[-1]), jnp.float32))
        return jax.lax.fori_loop(first, i + 1, absorb, start)

    return jax.tree.map(lambda a: a.reshape(num_tokens, *a.shape[2:]), jax.lax.map(query_tile, jnp.arange(tiles)))


def _own_scores(q, k, segment_q, segment_k, position_q, position_k):
    """Scores [T, K, G, U] of queries [T, K, G, H] against this step's keys [U, K, H], NEG_INF where
    the key is of another row or later in the query's."""
    visible = (segment_q[:, None] == segment_k[None, :]) & (position_k[None, :] <= position_q[:, None])
    scores = jnp.einsum("TKGH,UKH->TKGU", q, k, preferred_element_type=jnp.float32)
    return jnp.where(visible[:, None, None, :], scores, NEG_INF)


def _combined(a, b):
    """One running softmax (max, sum, weighted values) state from two over disjoint keys."""
    top = jnp.maximum(a[0], b[0])
    scale_a, scale_b = jnp.exp(a[0] - top), jnp.exp(b[0] - top)
    return top, a[1] * scale_a + b[1] * scale_b, a[2] * scale_a[..., None] + b[2] * scale_b[..., None]


def _fold(state, scores, values, spec: str):
    """A running softmax's (max, sum, weighted values) state with one more block of scores
    [T, K, G, S] and its values (`spec`: the einsum of the probabilities and values to [T, K, G, H])."""
    top, total, out = state
    new_top = jnp.maximum(top, scores.max(-1))
    rescale = jnp.exp(top - new_top)
    p = jnp.exp(scores - new_top[..., None])
    weighted = jnp.einsum(spec, p.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return new_top, total * rescale + p.sum(-1), out * rescale[..., None] + weighted


def _attend_page_lists(q, cache: KVCache, layer: jax.Array, ctx: PagedContext, state):
    """Fold each token's cached pages into its running (max, sum, weighted values) state, a chunk
    of every token's list at a time: one gather of [T, chunk] pages per loop iteration, attended
    batched over the tokens. The loop runs as many iterations as the longest cached context in the
    step needs (a while loop with the step's count), so the columns past it cost nothing; a shorter
    row's extra pages are page 0, masked. Indexing the cache by layer and page in one gather reads
    just those pages; a `cache.k[layer]` first would copy the layer's whole cache.

    The chunk is chosen per step among powers of 2 up to LIST_CHUNK_PAGES / T pages (every
    branch compiled, one taken): the smallest that holds the longest context, so a short context
    gathers little past its pages and a long one takes few iterations (docs/journal.md,
    "Page lists": powers of 4 gathered up to twice the pages and lost to pairs at short contexts)."""
    num_tokens, columns = ctx.pages.shape
    largest = min(columns, max(1, LIST_CHUNK_PAGES // num_tokens))
    chunks = [c for c in (1, 2, 4, 8, 16, 32, 64, 128, 256) if c < largest] + [largest]
    needed = (ctx.cached.max() + cache.k.shape[2] - 1) // cache.k.shape[2]  # pages of the longest context
    branch = jnp.minimum(jnp.searchsorted(jnp.array(chunks), needed), len(chunks) - 1)
    return jax.lax.switch(branch, [partial(_page_list_loop, chunk=c) for c in chunks], q, cache, layer, ctx, state)


def _page_list_loop(q, cache: KVCache, layer: jax.Array, ctx: PagedContext, state, chunk: int):
    """_attend_page_lists' loop, `chunk` pages of every token's list per iteration."""
    num_tokens, columns = ctx.pages.shape
    width = chunk * cache.k.shape[2]  # S: positions per iteration
    pages = jnp.pad(ctx.pages, ((0, 0), (0, -columns % chunk))).reshape(num_tokens, -1, chunk).transpose(1, 0, 2)  # [O / chunk, T, chunk]

    def absorb(i, state):
        keys = from_cache(cache.k[layer, pages[i]].reshape(num_tokens, width, *cache.k.shape[3:]))  # [T, S, K, H]
        values = from_cache(cache.v[layer, pages[i]].reshape(keys.shape))
        # Scores as a multiply-and-sum, which XLA fuses with the gather (on XLA:CPU, 20-40% faster
        # than an einsum over the gathered keys: docs/journal.md, "Page lists").
        scores = (q[:, None].astype(jnp.float32) * keys[:, :, :, None, :]).sum(-1).transpose(0, 2, 3, 1)  # [T, K, G, S]
        visible = i * width + jnp.arange(width)[None, :] < ctx.cached[:, None]  # [T, S]
        return _fold(state, jnp.where(visible[:, None, None, :], scores, NEG_INF), values, "TKGS,TSKH->TKGH")

    return jax.lax.fori_loop(0, (ctx.cached.max() + width - 1) // width, absorb, state)


def _attend_pairs(q, cache: KVCache, layer: jax.Array, ctx: PagedContext, state):
    """Fold the cached pages of every pair into the running (max, sum, weighted values) state,
    PAIR_CHUNK pairs at a time: a chunk's gathered pages stay in the CPU's cache and in one reused
    buffer, where gathering all W at once wrote (and page-faulted) W pages of fresh memory per layer.
    The loop runs over the chunks that hold real pairs only (a while loop with the step's count)."""
    num_tokens, num_pairs = q.shape[0], ctx.pair_page.shape[0]
    chunk = min(PAIR_CHUNK, num_pairs)
    extra = -num_pairs % chunk  # padding pairs up to whole chunks: query token T, nothing visible
    pairs = (ctx.pair_token, ctx.pair_page, ctx.pair_start, ctx.pair_limit)
    pairs = [jnp.pad(a, (0, extra), constant_values=fill).reshape(-1, chunk) for a, fill in zip(pairs, (num_tokens, 0, 0, 0))]

    def absorb(state, chunk_pairs):
        top, total, out = state
        token, page, start, limit = chunk_pairs
        pages_k = from_cache(cache.k[layer, page])  # [C, Z, K, H]
        pages_v = from_cache(cache.v[layer, page])
        visible = start[:, None] + jnp.arange(pages_k.shape[1])[None, :] < limit[:, None]  # [C, Z]: offsets past the row's cached length
        q_pair = jnp.take(q, token, axis=0, mode="fill", fill_value=0)  # [C, K, G, H]
        scores = jnp.einsum("CKGH,CZKH->CKGZ", q_pair, pages_k, preferred_element_type=jnp.float32)
        scores = jnp.where(visible[:, None, None, :], scores, NEG_INF)  # [C, K, G, Z]
        new_top = jnp.maximum(top, jax.ops.segment_max(scores.max(-1), token, num_tokens, indices_are_sorted=True))
        rescale = jnp.exp(top - new_top)  # [T, K, G]
        p = jnp.exp(scores - jnp.take(new_top, token, axis=0, mode="fill", fill_value=0)[..., None])
        total = total * rescale + jax.ops.segment_sum(p.sum(-1), token, num_tokens, indices_are_sorted=True)
        weighted = jnp.einsum("CKGZ,CZKH->CKGH", p.astype(pages_v.dtype), pages_v, preferred_element_type=jnp.float32)
        out = out * rescale[..., None] + jax.ops.segment_sum(weighted, token, num_tokens, indices_are_sorted=True)
        return (new_top, total, out), None

    # Pairs come first, padding after (batch.py): only the chunks holding real pairs run, so a
    # pairs bucket larger than the step's costs memory, not time.
    real = jnp.sum(ctx.pair_token < num_tokens)
    return jax.lax.fori_loop(0, (real + chunk - 1) // chunk,
                             lambda i, s: absorb(s, [a[i] for a in pairs])[0], state)


def ordered_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, layer: jax.Array, ctx: PagedContext,
                      every_chunk: bool = False) -> jax.Array:
    """batch_invariant's attention: q [T, N, H], this step's k and v [T, K, H] -> [T, N, H].

    The pairs (batch.py, `every_page`) list every page of a token's row up to its own position, the
    token's pages in order; a slot at or past the pair's limit is this step's, read from k and v
    (the step writes them into the cache after every layer). Two passes over the pairs: the max of
    each token's scores (exact in any order), then each pair's page sums of exp(score - max) and
    of the weighted values, added into the token's totals one pair at a time in pair order (a
    scatter-add applies its updates in order). So a token's result depends on its own context
    alone: not on the step's other tokens, the chunk a pair falls in, or which of its keys an
    earlier step wrote. A trainer gets the same bits by calling this with a whole sequence as one
    step (an empty cache, every key this step's), with `every_chunk` (a loop of static length,
    which reverse-mode differentiation needs) instead of the real chunks only."""
    num_tokens, heads, head_dim = q.shape
    kv_heads, page_size = k.shape[1], cache.k.shape[2]
    if ctx.pair_page.shape[0] == 0:  # a pairs bucket of 0 (compiled, never fit: every token reads its own page)
        return jnp.zeros_like(q)
    q = q.reshape(num_tokens, kv_heads, heads // kv_heads, head_dim) * head_dim**-0.5  # [T, K, G, H]
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
        s = jnp.einsum("CKGH,CZKH->CKGZ", q_pair, keys, preferred_element_type=jnp.float32)
        visible = position <= own[:, None]  # [C, Z]
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
    top = jax.lax.stop_gradient(jax.lax.fori_loop(0, chunks, peak, jnp.full(state, NEG_INF, jnp.float32)))
    total, out = jax.lax.fori_loop(0, chunks, absorb, (jnp.zeros(state, jnp.float32), jnp.zeros((*state, head_dim), jnp.float32)))
    out = jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)  # padding tokens: 0
    return out.reshape(num_tokens, heads, head_dim).astype(q.dtype)
