"""Grouped-query attention over the paged KV cache, in pure jax.numpy (the `native` backend).

`paged_attention`: a step's queries attend two sources, combined in one softmax:

- the cache: what earlier steps wrote, read one of two ways, whichever the step's shape compiled
  (batch.py's Buckets chooses by its token count):
  - page lists (decode and short chunks): each token lists its row's cached pages in order, and a
    loop gathers a chunk of every token's pages at a time and attends them batched over the
    tokens, as many iterations as the step's longest context needs, from the first page any of
    its tokens still sees (a sliding window's: the pages below it are never read);
  - (token, page) pairs (prefill chunks): the work list holds one pair per cached page of each
    token's row, consumed PAIR_CHUNK pairs at a time, so a long chunk over a long context costs
    what its pairs cost, bucketed, whatever mix of rows shares the step. The list is the step's,
    the same for every layer: a windowed layer masks the pairs' positions below its window.
  Either way a running (online) softmax carries each token's state from one chunk to the next
  (softmax_state.py). Where the model's kernels attend (Numerics.kernels, kernels.py; on XLA:CPU),
  page lists are read by a kernel instead, which returns the same state over the cache, and the
  engine then reads every step's cache through page lists (batch.py's `Buckets.choose_page_lists`);
- this step's own keys and values (causal within the row), which the step writes into the cache
  only after every layer has read it. Reading and writing the cache in the same layer would make
  XLA copy the whole cache to keep the read consistent. The kernels attend them too (`own_state`):
  each token its own row's keys alone, where the tiles below score whole tiles of other rows and
  later positions only to mask them.

A layer's own terms (softmax_state.py): its query scale, soft-capping (Gemma 2), its sliding window
(one per layer of the model, indexed by the traced layer index: a mixed local/global stack stays one
scanned body), sinks (GPT-OSS). The paged cache and its context: paged.py. `ordered_attention`
(worker.batch_invariant): ordered_attention.py.

Shapes in the legend of worker_svc/__init__.py.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.kernels import Kernels
from worker_svc.layers.lora import adapted
from worker_svc.layers.norms import RMSNorm
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.ordered_attention import PAIR_CHUNK, ordered_attention
from worker_svc.layers.paged import (BF16_BITS, KVCache, PagedContext, as_cached, from_cache, pages_up_to,  # noqa: F401 (re-exported)
                                     storage_dtype, to_cache)
from worker_svc.layers.quantized import weight
from worker_svc.layers.rotary import Rope
from worker_svc.layers.softmax_state import NEG_INF, capped, combined, fold, in_window, lowest_visible, with_sinks

OWN_TILE = 128  # tokens per tile when a step's tokens attend each other by tiles
OWN_DENSE_TOKENS = 256  # steps of up to this many tokens attend each other densely, T x T
LIST_CHUNK_PAGES = 128  # pages the page-list loop gathers per iteration, at most, over all of a step's tokens


class Attention(nnx.Module):
    """`qk_norm_eps` given (Qwen3): an RMSNorm over each head's dimensions on q and k, before rotary
    (`qk_norm_offset`: Gemma's (offset + w) scale). `qkv_bias` (Qwen2): a bias added to each head's q,
    k and v (never quantized: it is not a matmul's). `scale`: the queries' (None: head_dim**-0.5).
    `softcap`: scores soft-capped (Gemma 2). `windows`: each layer's sliding window, by the layer index
    the layer is called with (0: full; None: every layer full). `sinks` (GPT-OSS): a learned logit per
    query head in the softmax's denominator. `o_bias`: a bias after the output projection."""

    ADAPTED = ("q", "k", "v", "o")  # the projections that add LoRA deltas (layers/lora.py)
    IN_PLACE = ("q", "k", "v", "o")  # in a step of few rows, read in place in their stack by a kernel (stack_layer.py)

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, *, qk_norm_eps: float | None = None,
                 qk_norm_offset: float = 0.0, qkv_bias: bool = False, scale: float | None = None, softcap: float | None = None,
                 windows: tuple[int, ...] | None = None, sinks: bool = False, o_bias: bool = False,
                 numerics: Numerics = Numerics(), dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.numerics = numerics
        int8, std = numerics.quantization, dim**-0.5
        self.q = weight(rngs, (dim, heads, head_dim), std, ("embed", "heads", "head_dim"), (0,), dtype, int8)  # [D, N, H]
        self.k = weight(rngs, (dim, kv_heads, head_dim), std, ("embed", "kv_heads", "head_dim"), (0,), dtype, int8)  # [D, K, H]
        self.v = weight(rngs, (dim, kv_heads, head_dim), std, ("embed", "kv_heads", "head_dim"), (0,), dtype, int8)  # [D, K, H]
        self.o = weight(rngs, (heads, head_dim, dim), (heads * head_dim)**-0.5, ("heads", "head_dim", "embed"), (0, 1), dtype,
                        int8)  # [N, H, D]
        with_norm = qk_norm_eps is not None
        norm = partial(RMSNorm, head_dim, qk_norm_eps, offset=qk_norm_offset, numerics=numerics, dtype=dtype)
        self.q_norm = norm() if with_norm else None  # scale [H], shared by the heads
        self.k_norm = norm() if with_norm else None
        # Random stand-ins as the weights' (loading.py fills them), so a model built without a checkpoint adds them too.
        self.q_bias = _bias(rngs, (heads, head_dim), ("heads", "head_dim"), dtype) if qkv_bias else None  # [N, H]
        self.k_bias = _bias(rngs, (kv_heads, head_dim), ("kv_heads", "head_dim"), dtype) if qkv_bias else None  # [K, H]
        self.v_bias = _bias(rngs, (kv_heads, head_dim), ("kv_heads", "head_dim"), dtype) if qkv_bias else None  # [K, H]
        self.sinks = _bias(rngs, (heads,), ("heads",), dtype) if sinks else None  # [N]
        self.o_bias = _bias(rngs, (dim,), ("embed",), dtype) if o_bias else None  # [D]
        self.scale, self.softcap = scale, softcap
        # Static; only a model with some windowed layer traces the window mask at all.
        self.windows = tuple(int(w) for w in windows) if windows is not None and any(windows) else None

    def __call__(
        self, x: jax.Array, rope: Rope, cache: KVCache, layer: jax.Array, ctx: PagedContext
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [T, D] -> (output [T, D], this step's keys [T, K, H] and values [T, K, H] to write)."""
        matmul = self.numerics.matmul
        q = adapted(ctx.lora, "q", layer, x, matmul("TD,DNH->TNH", x, self.q[...]), self.numerics)
        k = adapted(ctx.lora, "k", layer, x, matmul("TD,DKH->TKH", x, self.k[...]), self.numerics)
        v = adapted(ctx.lora, "v", layer, x, matmul("TD,DKH->TKH", x, self.v[...]), self.numerics)
        if self.q_bias is not None:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q), rope(k)
        terms = dict(scale=self.scale, softcap=self.softcap, sinks=None if self.sinks is None else self.sinks[...],
                     window=None if self.windows is None else jnp.asarray(self.windows, jnp.int32)[layer])
        if self.numerics.batch_invariant:
            out = ordered_attention(q, k, v, cache, layer, ctx, **terms)
        else:
            out = paged_attention(q, k, v, cache, layer, ctx, kernels=self.numerics.kernels, **terms)
        out = adapted(ctx.lora, "o", layer, out, matmul("TNH,NHD->TD", out, self.o[...]), self.numerics)
        return (out if self.o_bias is None else out + self.o_bias[...]), k, v


def _bias(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], dtype: jnp.dtype) -> nnx.Param:
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype), out_sharding=names, eager_sharding=False)


def paged_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, layer: jax.Array, ctx: PagedContext,
    kernels: Kernels | None = None, *, scale: float | None = None, softcap: float | None = None,
    window: jax.Array | None = None, sinks: jax.Array | None = None
) -> jax.Array:
    """q [T, N, H], this step's k and v [T, K, H] -> [T, N, H]. Softmax in float32. `kernels`
    (Numerics.kernels): the step's own keys and the page lists attended by them where they apply.
    `scale` (None: H**-0.5), `softcap`, `window` (the layer's, traced; None: full) and `sinks` [N]:
    softmax_state.py's terms."""
    num_tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(num_tokens, kv_heads, heads // kv_heads, head_dim) * (head_dim**-0.5 if scale is None else scale)  # [T, K, G, H]
    k, v = as_cached(k, cache.k.dtype), as_cached(v, cache.v.dtype)

    # Running softmax state per token, started from this step's own keys: max, sum, weighted values.
    state = None if kernels is None else kernels.own_state(q, k, v, ctx.segment, window, softcap)
    if state is None:
        tiles = num_tokens > OWN_DENSE_TOKENS and num_tokens % OWN_TILE == 0
        state = (_attend_own_tiles if tiles else _attend_own)(q, k, v, ctx.segment, ctx.positions, softcap, window)

    if ctx.pages.shape[1]:  # the shape's layout (batch.py): page lists, pairs, or neither (no cached context)
        cached = None if kernels is None else kernels.cached_state(q, cache.k, cache.v, layer, ctx.pages, ctx.cached,
                                                                   None if window is None else lowest_visible(ctx.positions, window), softcap)
        if cached is None:
            state = _attend_page_lists(q, cache, layer, ctx, state, softcap, window)
        else:
            state = combined(state, cached)
    elif ctx.pair_page.shape[0]:
        state = _attend_pairs(q, cache, layer, ctx, state, softcap, window)
    _, total, out = with_sinks(state, None if sinks is None else sinks.reshape(kv_heads, -1))
    return (out / total[..., None]).reshape(num_tokens, heads, -1).astype(q.dtype)  # values' dimension, H unless they differ


def _attend_own(q, k, v, segment, positions, softcap=None, window=None):
    """The (max, sum, weighted values) state [T, K, G], [T, K, G], [T, K, G, H] of queries q [T, K, G, H]
    over keys and values [U, K, H] of their own row (`segment`), not later in it (`positions`), in
    the window. Padding tokens (row -1) see each other only, so every state is finite."""
    scores = _own_scores(q, k, segment, segment, positions, positions, softcap, window)
    top = scores.max(-1)
    p = jnp.exp(scores - top[..., None])
    return top, p.sum(-1), jnp.einsum("TKGU,UKH->TKGH", p.astype(v.dtype), v, preferred_element_type=jnp.float32)


def _attend_own_tiles(q, k, v, segment, positions, softcap=None, window=None):
    """_attend_own block by block: queries in tiles of OWN_TILE tokens, each attending only the key
    tiles from the one where its first token's row starts (or its window does, if later) up to its
    own (a while loop, running softmax). A step lays each row's tokens out contiguously in position
    order (batch.py), so a query never sees a later tile, nor one before its rows began: a step
    packing many short prompts costs their own blocks, not T x T, and one long prompt about half.
    Scores stay in a [OWN_TILE, K, G, OWN_TILE] block that fits the CPU's cache, where [T, K, G, T] did not."""
    num_tokens, tile = q.shape[0], OWN_TILE
    tiles = num_tokens // tile
    q, k, v, rows, spots = (a.reshape(tiles, tile, *a.shape[1:]) for a in (q, k, v, segment, positions))

    def query_tile(i):
        first = jnp.argmax(segment == rows[i, 0]) // tile  # the tile where the tile's first row starts
        if window is not None:  # the tile's first token sees none before its window; the later ones, fewer
            first = jnp.maximum(first, jnp.where(window > 0, (i * tile - window + 1) // tile, 0))

        def absorb(j, state):
            scores = _own_scores(q[i], k[j], rows[i], rows[j], spots[i], spots[j], softcap, window)
            return fold(state, scores, v[j], "TKGU,UKH->TKGH")

        shape = q.shape[1:4]  # [tile, K, G]
        start = (jnp.full(shape, NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros((*shape, q.shape[-1]), jnp.float32))
        return jax.lax.fori_loop(first, i + 1, absorb, start)

    return jax.tree.map(lambda a: a.reshape(num_tokens, *a.shape[2:]), jax.lax.map(query_tile, jnp.arange(tiles)))


def _own_scores(q, k, segment_q, segment_k, position_q, position_k, softcap=None, window=None):
    """Scores [T, K, G, U] of queries [T, K, G, H] against this step's keys [U, K, H], NEG_INF where
    the key is of another row, later in the query's or below its window."""
    visible = (segment_q[:, None] == segment_k[None, :]) & (position_k[None, :] <= position_q[:, None])
    visible &= in_window(position_k[None, :], position_q[:, None], window)
    scores = capped(jnp.einsum("TKGH,UKH->TKGU", q, k, preferred_element_type=jnp.float32), softcap)
    return jnp.where(visible[:, None, None, :], scores, NEG_INF)


def _attend_page_lists(q, cache: KVCache, layer: jax.Array, ctx: PagedContext, state, softcap=None, window=None):
    """Fold each token's cached pages into its running (max, sum, weighted values) state, a chunk
    of every token's list at a time: one gather of [T, chunk] pages per loop iteration, attended
    batched over the tokens. The loop runs from the first page any real token of the step still
    sees (0, unless the layer slides: its window's first page) to the last of the longest cached
    context (a while loop with the step's counts), so the columns outside cost nothing; a shorter
    row's extra pages are page 0, masked. Indexing the cache by layer and page in one gather reads
    just those pages; a `cache.k[layer]` first would copy the layer's whole cache.

    The chunk is chosen per step among powers of 2 up to LIST_CHUNK_PAGES / T pages (every
    branch compiled, one taken): the smallest that holds the pages the loop reads, so a short
    context (or window) gathers little past its pages and a long one takes few iterations
    (docs/journal.md, "Page lists": powers of 4 gathered up to twice the pages and lost to pairs
    at short contexts)."""
    num_tokens, columns = ctx.pages.shape
    page_size = cache.k.shape[2]
    largest = min(columns, max(1, LIST_CHUNK_PAGES // num_tokens))
    chunks = [c for c in (1, 2, 4, 8, 16, 32, 64, 128, 256) if c < largest] + [largest]
    last = (ctx.cached.max() + page_size - 1) // page_size  # pages of the longest context
    first = 0
    if window is not None:  # padding tokens (row -1) see nothing cached
        lowest = jnp.where(ctx.segment >= 0, lowest_visible(ctx.positions, window), jnp.iinfo(jnp.int32).max)
        first = jnp.minimum(lowest.min() // page_size, last)
    branch = jnp.minimum(jnp.searchsorted(jnp.array(chunks), last - first), len(chunks) - 1)
    return jax.lax.switch(branch, [partial(_page_list_loop, chunk=c, softcap=softcap, window=window) for c in chunks],
                          q, cache, layer, ctx, state, first)


def _page_list_loop(q, cache: KVCache, layer: jax.Array, ctx: PagedContext, state, first, chunk: int, softcap, window):
    """_attend_page_lists' loop, `chunk` pages of every token's list per iteration from its page `first`."""
    num_tokens = ctx.pages.shape[0]
    width = chunk * cache.k.shape[2]  # S: positions per iteration
    pages = jnp.pad(ctx.pages, ((0, 0), (0, chunk)))  # [T, O + chunk]: the last iteration's slice ends inside

    def absorb(i, state):
        at = first + i * chunk  # the iteration's first page in the lists
        listed = jax.lax.dynamic_slice_in_dim(pages, at, chunk, axis=1)  # [T, chunk]
        keys = from_cache(cache.k[layer, listed].reshape(num_tokens, width, *cache.k.shape[3:]))  # [T, S, K, H]
        values = from_cache(cache.v[layer, listed].reshape(keys.shape))
        # Scores as a multiply-and-sum, which XLA fuses with the gather (on XLA:CPU, 20-40% faster
        # than an einsum over the gathered keys: docs/journal.md, "Page lists").
        scores = (q[:, None].astype(jnp.float32) * keys[:, :, :, None, :]).sum(-1).transpose(0, 2, 3, 1)  # [T, K, G, S]
        position = at * cache.k.shape[2] + jnp.arange(width)[None, :]  # [1, S]
        visible = (position < ctx.cached[:, None]) & in_window(position, ctx.positions[:, None], window)  # [T, S]
        return fold(state, jnp.where(visible[:, None, None, :], capped(scores, softcap), NEG_INF), values, "TKGS,TSKH->TKGH")

    return jax.lax.fori_loop(0, (ctx.cached.max() - first * cache.k.shape[2] + width - 1) // width, absorb, state)


def _attend_pairs(q, cache: KVCache, layer: jax.Array, ctx: PagedContext, state, softcap=None, window=None):
    """Fold the cached pages of every pair into the running (max, sum, weighted values) state,
    PAIR_CHUNK pairs at a time: a chunk's gathered pages stay in the CPU's cache and in one reused
    buffer, where gathering all W at once wrote (and page-faulted) W pages of fresh memory per layer.
    The loop runs over the chunks that hold real pairs only (a while loop with the step's count).
    A windowed layer masks the positions below its window (the pairs are every layer's)."""
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
        position = start[:, None] + jnp.arange(pages_k.shape[1])[None, :]  # [C, Z]
        own = jnp.take(ctx.positions, token, mode="fill", fill_value=0)[:, None]  # [C, 1]
        visible = (position < limit[:, None]) & in_window(position, own, window)  # [C, Z]: not past the row's cached length
        q_pair = jnp.take(q, token, axis=0, mode="fill", fill_value=0)  # [C, K, G, H]
        scores = capped(jnp.einsum("CKGH,CZKH->CKGZ", q_pair, pages_k, preferred_element_type=jnp.float32), softcap)
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


