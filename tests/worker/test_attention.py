"""paged_attention against a plain numpy softmax, through each of its ways to read: this step's
tokens densely and by tiles, the cache through page lists and through (token, page) pairs; the
packer's choice between the two cache layouts; and a bfloat16 cache (worker.kv_cache_dtype)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstream.arrays import to_wire
from jaxstream.protocol import SamplingParams, Step, StepSeq
from worker_svc.batch import Buckets, StepPacker
from worker_svc.layers.attention import (BF16_BITS, OWN_DENSE_TOKENS, OWN_TILE, KVCache, PagedContext, ordered_attention,
                                        paged_attention, storage_dtype, to_cache)

K, G, H, Z, P = 2, 2, 8, 4, 64  # kv heads, queries per kv head, head dim, page size, pages
rng = np.random.default_rng(3)


def reference(q, k, v, cache, rows, scale=H**-0.5, softcap=None, window=0, sinks=None):
    """Each token attends its row's cached positions and its row's step tokens up to itself (and
    from its `window`'s first), scores soft-capped, `sinks` [N] in the denominators."""
    t = 0
    out = np.zeros((sum(count for _, _, count in rows), *q.shape[1:]), q.dtype)
    for pages, cached, count in rows:
        keys = np.concatenate([cache.k[0, pages].reshape(-1, K, H)[:cached], k[t : t + count]])
        values = np.concatenate([cache.v[0, pages].reshape(-1, K, H)[:cached], v[t : t + count]])
        for i in range(count):
            seen = cached + i + 1
            lowest = max(0, seen - window) if window else 0
            scores = np.einsum("KGH,SKH->KGS", q[t + i].reshape(K, G, H) * scale, keys[lowest:seen])
            scores = scores if softcap is None else softcap * np.tanh(scores / softcap)
            sink = np.full((K, G, 1), -np.inf) if sinks is None else sinks.reshape(K, G, 1)
            top = np.maximum(scores.max(-1, keepdims=True), sink)
            p = np.exp(scores - top)
            total = p.sum(-1) + np.exp(sink - top)[..., 0]
            out[t + i] = (np.einsum("KGS,SKH->KGH", p, values[lowest:seen]) / total[..., None]).reshape(K * G, H)
        t += count
    return out


def step(rows, tokens, layout, columns=16):
    """A step's PagedContext for rows (pages, cached, count), padded to `tokens`, reading its
    cache through `layout`: "lists", "pairs" or "none" (nothing cached)."""
    positions, segment = np.zeros(tokens, np.int32), np.full(tokens, -1, np.int32)
    lists, cached_of = np.zeros((tokens, columns if layout == "lists" else 0), np.int32), np.zeros(tokens, np.int32)
    pairs = []
    t = 0
    for row, (pages, cached, count) in enumerate(rows):
        span = slice(t, t + count)
        positions[span], segment[span] = cached + np.arange(count), row
        used = -(-cached // Z)
        if layout == "lists":
            lists[span, :used], cached_of[span] = pages[:used], cached
        pairs += [(token, pages[i], i * Z, cached) for token in range(t, t + count) for i in range(used)]
        t += count
    width = 0 if layout != "pairs" else max(16, len(pairs))
    pair_token, pair_page, pair_start, pair_limit = (np.array([p[i] for p in pairs] + [fill] * (width - len(pairs)), np.int32)
                                                     for i, fill in enumerate((tokens, 0, 0, 0))) if width else [np.zeros(0, np.int32)] * 4
    return PagedContext(positions, segment, pair_token, pair_page, pair_start, pair_limit, lists, cached_of)


@pytest.mark.parametrize("layout", ["lists", "pairs"])
def test_cached_context_through_either_layout(layout):
    cache = KVCache(rng.standard_normal((1, P, Z, K, H), np.float32), rng.standard_normal((1, P, Z, K, H), np.float32))
    # Decode rows over 1, 3 and 15 pages (partial last pages), a short chunk, and a padding token.
    rows = [(rng.permutation(P)[:16], cached, count) for cached, count in ((3, 1), (9, 1), (58, 1), (17, 3))]
    tokens = 8
    q = rng.standard_normal((tokens, K * G, H), np.float32)
    k, v = rng.standard_normal((2, tokens, K, H), np.float32)
    got = jax.jit(paged_attention)(q, k, v, cache, 0, step(rows, tokens, layout))
    np.testing.assert_allclose(np.asarray(got)[:6], reference(q, k, v, cache, rows), atol=2e-5)


def test_a_large_step_attends_its_own_tokens_by_tiles_as_densely():
    """Rows spanning tile boundaries, short prompts sharing a tile, and padding, in a step large
    enough to go by tiles."""
    tokens = 4 * OWN_TILE
    assert tokens > OWN_DENSE_TOKENS
    cache = KVCache(np.zeros((1, P, Z, K, H), np.float32), np.zeros((1, P, Z, K, H), np.float32))
    rows = [(np.zeros(16, np.int32), 0, count) for count in (200, 90, 7, 150, 40)]  # 487 tokens, then padding
    q = rng.standard_normal((tokens, K * G, H), np.float32)
    k, v = rng.standard_normal((2, tokens, K, H), np.float32)
    got = jax.jit(paged_attention)(q, k, v, cache, 0, step(rows, tokens, "none"))
    np.testing.assert_allclose(np.asarray(got)[:487], reference(q, k, v, cache, rows), atol=2e-5)


TERMS = dict(scale=0.3, softcap=2.5, sinks=rng.standard_normal(K * G).astype(np.float32))


@pytest.mark.parametrize("layout", ["lists", "pairs", "none", "tiles"])
def test_a_layers_window_softcap_scale_and_sinks_on_every_way_to_read(layout):
    """A window of 7 over rows that decode past it (a long row's first pages unread by page lists),
    a chunk straddling it, and prompts longer than it within the step (densely or by tiles)."""
    cache = KVCache(rng.standard_normal((1, P, Z, K, H), np.float32), rng.standard_normal((1, P, Z, K, H), np.float32))
    if layout in ("none", "tiles"):
        counts = (200, 90, 7, 150, 40) if layout == "tiles" else (30, 3, 12)
        rows = [(np.zeros(16, np.int32), 0, count) for count in counts]
        tokens = 4 * OWN_TILE if layout == "tiles" else 48
    else:
        rows = [(rng.permutation(P)[:16], cached, count) for cached, count in ((30, 1), (58, 1), (17, 9))]  # lists from page 2
        tokens = 16
    q = rng.standard_normal((tokens, K * G, H), np.float32)
    k, v = rng.standard_normal((2, tokens, K, H), np.float32)
    attend = jax.jit(functools.partial(paged_attention, scale=TERMS["scale"], softcap=TERMS["softcap"]))
    ctx = step(rows, tokens, "none" if layout == "tiles" else layout)
    real = sum(count for _, _, count in rows)
    for window in (7, 0):  # a sliding layer and a full one of the same model: the window is data
        got = attend(q, k, v, cache, 0, ctx, window=jnp.int32(window), sinks=TERMS["sinks"])
        want = reference(q, k, v, cache, rows, window=window, **TERMS)
        np.testing.assert_allclose(np.asarray(got)[:real], want, atol=2e-5)


def test_batch_invariant_attention_takes_a_layers_window_softcap_scale_and_sinks():
    """ordered_attention over a whole row as one step, against the reference."""
    n = 23
    q = rng.standard_normal((n, K * G, H), np.float32)
    k, v = rng.standard_normal((2, n, K, H), np.float32)
    empty = KVCache(*np.zeros((2, 1, P, Z, K, H), np.float32))
    got = jax.jit(functools.partial(ordered_attention, scale=TERMS["scale"], softcap=TERMS["softcap"]))(
        q, k, v, empty, 0, PagedContext.sequence(n, Z), window=jnp.int32(6), sinks=TERMS["sinks"])
    np.testing.assert_allclose(np.asarray(got), reference(q, k, v, empty, [(np.zeros(16, np.int32), 0, n)], window=6, **TERMS),
                               atol=2e-5)


def test_a_decode_step_reads_page_lists_in_one_sub_step_where_pairs_would_cut_it():
    """8 rows over 20 cached pages each: 160 pairs, more than the largest pairs bucket holds."""
    buckets = Buckets(tokens=(2, 4, 8, 16), pairs=(0, 16, 64), max_rows=8, max_pages=24, page_list_tokens=8)
    table = rng.permutation(8 * 21).astype(np.int32).reshape(8, 21)
    seqs = tuple(StepSeq(f"r{i}", i, 1, 80, True, SamplingParams(), prompt_len=40) for i in range(8))
    step = Step(0, seqs, to_wire(np.ones(8, np.int32)), to_wire(np.full(8, 79, np.int32)), to_wire(table))
    params = [seq.sampling for seq in seqs]
    (sub,) = StepPacker(buckets, Z, P * 4, 0).pack(step, params)
    assert sub.shape == (8, 0, 24)
    np.testing.assert_array_equal(sub.inputs.ctx.pages[:, :20], table[:, :20])
    assert (sub.inputs.ctx.pages[:, 20:] == 0).all() and (sub.inputs.ctx.cached == 79).all()
    pairs = StepPacker(dataclasses.replace(buckets, page_list_tokens=0), Z, P * 4, 0).pack(step, params)
    assert len(pairs) == 3 and all(sub.shape[1] == 64 for sub in pairs)  # 3 rows of 20 pairs each, at most


def rounded(a):
    """a's values rounded to bfloat16, in float32."""
    return np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize("layout", ["lists", "pairs"])
def test_a_bfloat16_cache_attends_as_a_float32_cache_of_the_rounded_keys_and_values(layout):
    """Held as bfloat16's bits (half the bytes) and widened on read, exactly; this step's own keys
    and values are rounded as the cache will hold them."""
    assert storage_dtype(jnp.float32, "bfloat16") == BF16_BITS and storage_dtype(jnp.bfloat16, "bfloat16") == jnp.bfloat16
    assert storage_dtype(jnp.float32, "auto") == jnp.float32
    k_cache, v_cache = rng.standard_normal((2, 1, P, Z, K, H), np.float32)
    bits = KVCache(to_cache(k_cache, BF16_BITS), to_cache(v_cache, BF16_BITS))
    assert bits.k.dtype == BF16_BITS and 2 * bits.k.nbytes == k_cache.nbytes
    wide = KVCache(rounded(k_cache), rounded(v_cache))
    rows = [(rng.permutation(P)[:16], cached, count) for cached, count in ((3, 1), (9, 1), (58, 1), (17, 3))]
    q = rng.standard_normal((8, K * G, H), np.float32)
    k, v = rng.standard_normal((2, 8, K, H), np.float32)
    ctx = step(rows, 8, layout)
    got = np.asarray(jax.jit(paged_attention)(q, k, v, bits, 0, ctx))
    want = np.asarray(jax.jit(paged_attention)(q, rounded(k), rounded(v), wide, 0, ctx))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got[:6], reference(q, rounded(k), rounded(v), wide, rows), atol=2e-5)


def test_batch_invariant_attention_counts_a_bfloat16_cached_key_as_the_step_that_wrote_it_did():
    """ordered_attention: the last token of a row, its earlier keys written into a bfloat16 cache by
    an earlier step, gives the bits it gives when the whole row is one step (every key fresh)."""
    n = 23
    q = rng.standard_normal((n, K * G, H), np.float32)
    k, v = rng.standard_normal((2, n, K, H), np.float32)
    empty = KVCache(*np.zeros((2, 1, P, Z, K, H), np.uint16))
    whole = jax.jit(ordered_attention)(q, k, v, empty, 0, PagedContext.sequence(n, Z))
    slots = np.zeros((2, 1, P * Z, K, H), np.uint16)
    slots[:, 0, : n - 1] = np.asarray(to_cache(np.stack([k, v])[:, : n - 1], BF16_BITS))
    cache = KVCache(*slots.reshape(2, 1, P, Z, K, H))
    pages = np.arange((n - 1) // Z + 1, dtype=np.int32)  # every page up to the token's own
    ctx = PagedContext(positions=np.array([n - 1], np.int32), segment=np.zeros(1, np.int32),
                       pair_token=np.zeros(len(pages), np.int32), pair_page=pages, pair_start=pages * Z,
                       pair_limit=np.full(len(pages), n - 1, np.int32), pages=np.zeros((1, 0), np.int32),
                       cached=np.array([n - 1], np.int32))
    alone = jax.jit(ordered_attention)(q[-1:], k[-1:], v[-1:], cache, 0, ctx)
    np.testing.assert_array_equal(np.asarray(alone)[0], np.asarray(whole)[-1])
    float32 = KVCache(*np.zeros((2, 1, P, Z, K, H), np.float32))
    changed = jax.jit(ordered_attention)(q, k, v, float32, 0, PagedContext.sequence(n, Z))
    assert not np.array_equal(np.asarray(changed)[-1], np.asarray(whole)[-1])  # a float32 cache keeps the keys unrounded
