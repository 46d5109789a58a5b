"""The attention kernel (worker.attention_kernel, cpu_kernels/attention_kernel.py): built with this
machine's compiler, attention through it against the jax.numpy page-list loop over float32 and
bfloat16 caches, contexts of several segments and pages scattered, and over a step's own keys
against the dense loop; each token's state a function of
its own queries and context alone (bit for bit); what it leaves to the loop; a tiny model served with
it as without it, its cache still updated in place; the config turning it on only where it applies.
A failed build: test_product_kernel.py, for both kernels."""

import logging
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxstream import protocol
from jaxstream.config import load_config
from tests.worker.conftest import NUM_PAGES, PAGE_SIZE, TINY
from tests.worker.hlo_check import full_copies
from tests.worker.driver import Driver
from tests.worker.test_swap import logits
from worker_svc import start
from worker_svc.batch import PAGE_LIST_TOKENS, Buckets
from worker_svc.cpu_kernels import attention_kernel
from worker_svc.cpu_kernels.kernels import CpuKernels
from worker_svc.engine import Engine
from worker_svc.layers import attention
from worker_svc.layers.numerics import Numerics
from worker_svc.models.llama import Llama

MISSING = attention_kernel.load()  # "" once built and registered (cached in ~/.cache/jaxstream/kernels)
needs_kernel = pytest.mark.skipif(bool(MISSING), reason=f"the attention kernel cannot be built here: {MISSING}")

KV_HEADS, LAYERS = 2, 2
CONTEXTS = [0, 1, 16, 37, 300, 517]  # nothing cached, a page's edge, several of the kernel's 256-position segments
ATTENTION = CpuKernels(attention=True)  # the attention kernel alone, as start-up injects it


def case(group: int, head_dim: int, storage: str, page_size: int, contexts=CONTEXTS, seed: int = 0):
    """Queries, a cache and the context of a step of one token per row, each row's pages scattered."""
    rng = np.random.default_rng(seed)
    counts = [-(-c // page_size) for c in contexts]
    pool = sum(counts) + 8
    shape = (LAYERS, pool, page_size, KV_HEADS, head_dim)
    cache = attention.KVCache(*(attention.to_cache(jnp.asarray(rng.standard_normal(shape), jnp.float32),
                                                   attention.storage_dtype(jnp.float32, storage)) for _ in range(2)))
    order = rng.permutation(pool).astype(np.int32)
    columns = max(counts)
    pages = np.zeros((len(contexts), columns), np.int32)
    for t, (start_at, n) in enumerate(zip(np.cumsum([0, *counts[:-1]]), counts)):
        pages[t, :n] = order[start_at:start_at + n]
    tokens = len(contexts)
    ctx = attention.PagedContext.padded(tokens, 0, columns)._replace(
        positions=np.array(contexts, np.int32), segment=np.arange(tokens, dtype=np.int32), pages=pages,
        cached=np.array(contexts, np.int32))
    q = jnp.asarray(rng.standard_normal((tokens, KV_HEADS * group, head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((tokens, KV_HEADS, head_dim)), jnp.float32) for _ in range(2))
    return q, k, v, cache, ctx


def attend(kernel: bool):
    kernels = ATTENTION if kernel else None
    return jax.jit(lambda q, k, v, cache, ctx: attention.paged_attention(q, k, v, cache, jnp.int32(1), ctx, kernels=kernels))


@needs_kernel
@pytest.mark.parametrize("group,head_dim,storage,page_size", [  # SmolLM2's heads, Qwen3's; each cache, two page sizes
    (3, 64, "auto", 4), (3, 64, "bfloat16", 16), (2, 128, "auto", 16), (2, 128, "bfloat16", 4)])
def test_the_kernel_attends_as_the_page_list_loop(group, head_dim, storage, page_size):
    q, k, v, cache, ctx = case(group, head_dim, storage, page_size)
    assert f"@{attention_kernel.TARGET}(" in attend(True).lower(q, k, v, cache, ctx).as_text()
    got, want = attend(True)(q, k, v, cache, ctx), attend(False)(q, k, v, cache, ctx)
    assert got.shape == want.shape == q.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


@needs_kernel
def test_a_tokens_state_is_a_function_of_its_own_queries_and_context_alone_bit_for_bit():
    q, _, _, cache, ctx = case(3, 64, "auto", 16)
    q = q.reshape(q.shape[0], KV_HEADS, 3, 64)
    state = jax.jit(lambda q, pages, cached: attention_kernel.cached_state(q, cache.k, cache.v, jnp.int32(1), pages, cached))
    together = [np.asarray(a) for a in state(q, ctx.pages, ctx.cached)]
    assert (together[0][0] == attention.NEG_INF).all() and (together[1][0] == 0).all()  # nothing cached
    for t in range(q.shape[0]):
        alone = state(q[t:t + 1], ctx.pages[t:t + 1], ctx.cached[t:t + 1])
        for a, b in zip(alone, together):
            np.testing.assert_array_equal(np.asarray(a)[0], b[t])
    for _ in range(3):  # the threads take the parts in another order each time; the sums stay put
        for a, b in zip(state(q, ctx.pages, ctx.cached), together):
            np.testing.assert_array_equal(np.asarray(a), b)


@needs_kernel
@pytest.mark.parametrize("group,head_dim", [(3, 64), (2, 128)])
def test_the_steps_own_keys_are_attended_as_the_dense_loop_and_each_rows_alone(group, head_dim):
    """own_state: rows of 300 tokens (two of the kernel's segments), 1 and 37, and padding, laid out
    as batch.py does (a row's tokens contiguous, in position order): as _attend_own within float32
    rounding for every real token; a padding token's state finite; a row's states the same bits
    whatever the other rows hold."""
    rng = np.random.default_rng(8)
    rows = [(0, 300, 12), (1, 1, 40), (2, 37, 0)]  # (segment, tokens, first position)
    segment = np.concatenate([np.full(n, r, np.int32) for r, n, _ in rows] + [np.full(6, -1, np.int32)])
    positions = np.concatenate([np.arange(p, p + n, dtype=np.int32) for _, n, p in rows] + [np.zeros(6, np.int32)])
    tokens = len(segment)
    q = jnp.asarray(rng.standard_normal((tokens, KV_HEADS, group, head_dim)), jnp.float32) * head_dim**-0.5
    k, v = (jnp.asarray(rng.standard_normal((tokens, KV_HEADS, head_dim)), jnp.float32) for _ in range(2))
    own = jax.jit(attention_kernel.own_state)
    got = own(q, k, v, segment)
    want = jax.jit(attention._attend_own)(q, k, v, segment, positions)
    real = segment >= 0
    final = [np.asarray(out / total[..., None]) for _, total, out in (got, want)]
    np.testing.assert_allclose(final[0][real], final[1][real], rtol=0, atol=2e-6)
    assert np.isfinite(final[0]).all()
    others = np.asarray(k).copy()
    others[300:] = rng.standard_normal(others[300:].shape)  # every row but the first
    for a, b in zip(own(q, jnp.asarray(others), v, segment), got):
        np.testing.assert_array_equal(np.asarray(a)[:300], np.asarray(b)[:300])


@needs_kernel
@pytest.mark.parametrize("window", [0, 5, 100])
def test_a_sliding_window_and_soft_capped_scores_are_attended_as_the_jax_loops(window):
    """A window (traced: 0 is a full layer of the same model) moves each token's first cached position
    up (100: into the 300- and 517-position contexts' second and third segments), and its own keys'
    first; scores capped at 3."""
    q, k, v, cache, ctx = case(2, 64, "bfloat16", 16, contexts=[16, 16, 300, 300, 300, 517])
    # Rows of two and three tokens and one, each contiguous and in position order after its cached ones.
    ctx = ctx._replace(segment=np.array([0, 0, 1, 1, 1, 2], np.int32), positions=ctx.cached + np.array([0, 1, 0, 1, 2, 0], np.int32))

    def attend(kernels):
        return jax.jit(lambda q, k, v, w: attention.paged_attention(q, k, v, cache, jnp.int32(1), ctx, kernels=kernels,
                                                                    softcap=3.0, window=w))
    assert f"@{attention_kernel.TARGET}(" in attend(ATTENTION).lower(q, k, v, jnp.int32(window)).as_text()
    got, want = attend(ATTENTION)(q, k, v, jnp.int32(window)), attend(None)(q, k, v, jnp.int32(window))
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-6)


def test_what_the_kernel_does_not_take_is_left_to_the_loop():
    q, _, _, cache, ctx = case(3, 64, "auto", 16, contexts=[5])
    q = q.reshape(1, KV_HEADS, 3, 64)

    def state(q, k, v):  # traced only (eval_shape): what the kernel takes, whether or not it builds here
        return jax.eval_shape(lambda q, k, v: attention_kernel.cached_state(q, k, v, jnp.int32(0), ctx.pages, ctx.cached), q, k, v)
    assert state(q, cache.k, cache.v) is not None
    assert state(q.astype(jnp.bfloat16), cache.k, cache.v) is None  # bfloat16 arithmetic (GPU, TPU)
    assert state(q, cache.k.astype(jnp.bfloat16), cache.v.astype(jnp.bfloat16)) is None  # a bfloat16 model's cache
    assert state(q[..., :32], cache.k[..., :32], cache.v[..., :32]) is None  # head dimension 32
    wide = jnp.tile(q, (1, 1, 3, 1))  # 9 query heads per key head
    assert state(wide, cache.k, cache.v) is None
    own_k = cache.k[0, 0, :1]  # [1, K, H]: the step's own keys and values
    assert attention_kernel.own_state(q, own_k, own_k, jnp.zeros(1, jnp.int32)) is not None
    assert attention_kernel.own_state(q.astype(jnp.bfloat16), own_k, own_k, jnp.zeros(1, jnp.int32)) is None
    assert attention_kernel.own_state(wide, own_k, own_k, jnp.zeros(1, jnp.int32)) is None


HEADS64 = replace(TINY, heads=6, kv_heads=2, head_dim=64)  # SmolLM2's head dimension and grouping
FEW = Buckets(tokens=(1, 4, 16), pairs=(0, 64), max_rows=8, max_pages=32, page_list_tokens=4)  # both layouts, fewer shapes


@needs_kernel
def test_a_tiny_model_serves_with_the_kernel_as_without_it_and_updates_its_cache_in_place():
    without, with_kernel = (Engine(Llama(replace(HEADS64, numerics=Numerics(kernels=k)), rngs=nnx.Rngs(0)),
                                   FEW, PAGE_SIZE, NUM_PAGES) for k in (None, ATTENTION))

    def calls(engine, shape):
        return engine.executables.lower_forward(shape).as_text().count(f"@{attention_kernel.TARGET}(")
    shapes = with_kernel.buckets.shapes()
    lists, pairs = next(s for s in shapes if s[2] and s[0] == 1), next(s for s in shapes if s[1])
    assert (calls(with_kernel, lists), calls(with_kernel, pairs), calls(without, lists)) == (1, 0, 0)  # one scan body
    a, b = logits(without), logits(with_kernel)  # a prefill and decode steps through page lists
    assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
    for shape, executable in with_kernel.executables.forwards.items():
        assert full_copies(executable.as_text(), with_kernel.cache.k.size) == [], shape


@needs_kernel
def test_by_default_every_step_the_kernel_can_read_reads_page_lists_and_serves_as_pairs_do():
    """worker.page_list_tokens null (Buckets' None): with the kernel every token bucket reads page lists,
    a long prompt's later chunks over its cached first ones included, and serves what pairs without
    the kernel serve; without the kernel the engine keeps PAGE_LIST_TOKENS, under batch_invariant pairs."""
    chosen = replace(FEW, page_list_tokens=None)

    def engine(kernel: bool, buckets: Buckets = chosen, **numerics) -> Engine:
        model = Llama(replace(HEADS64, numerics=Numerics(kernels=ATTENTION if kernel else None, **numerics)), rngs=nnx.Rngs(0))
        return Engine(model, buckets, PAGE_SIZE, NUM_PAGES)
    lists, pairs = engine(True), engine(False, replace(FEW, page_list_tokens=0))
    assert lists.buckets.page_list_tokens == FEW.tokens[-1] and all(w == 0 for _, w, _ in lists.buckets.shapes())
    assert engine(False).buckets.page_list_tokens == PAGE_LIST_TOKENS
    assert engine(True, batch_invariant=True).buckets.page_list_tokens == 0  # ordered_attention: pairs only
    request = ("x", np.random.default_rng(5).integers(0, HEADS64.vocab, 45).tolist(),  # chunks of 16 over 16 and 32 cached
               protocol.SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
    a, b = (np.stack(Driver(e, PAGE_SIZE, NUM_PAGES, 16, 8, keep_logits=True).run([request])["x"].logits) for e in (pairs, lists))
    assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)


def test_the_engine_turns_the_kernel_on_only_where_it_applies(monkeypatch, caplog):
    def attends(numerics: Numerics) -> bool:
        return numerics.kernels is not None and numerics.kernels.attention

    monkeypatch.setattr(attention_kernel, "load", lambda: "")
    assert attends(start.numerics(load_config([])))
    assert attends(start.numerics(load_config(["worker.quantization=int8"])))
    assert not attends(start.numerics(load_config([]), devices=2))  # a mesh: no sharding rule
    assert not attends(start.numerics(load_config(["worker.batch_invariant=true"])))  # ordered_attention
    assert not attends(start.numerics(load_config(["worker.attention_kernel=false"])))
    monkeypatch.setattr(attention_kernel, "load", lambda: "no C++ compiler (c++, g++, clang++ or $CXX) on PATH")
    with caplog.at_level(logging.WARNING, logger="worker_svc.start"):
        assert not attends(start.numerics(load_config([])))
    assert "decode attention runs in XLA" in caplog.text and "no C++ compiler" in caplog.text



@needs_kernel
def test_the_kernel_refuses_a_grouping_it_was_not_compiled_for():
    """cached_state never hands it one; called directly, it says so rather than return garbage."""
    q, _, _, cache, ctx = case(3, 64, "auto", 16, contexts=[5])
    q = jnp.tile(q.reshape(1, KV_HEADS, 3, 64), (1, 1, 2, 1))[:, :, :5]  # 5 query heads per key head
    heads = jax.ShapeDtypeStruct((1, KV_HEADS, 5), jnp.float32)
    call = jax.ffi.ffi_call(attention_kernel.TARGET, (heads, heads, jax.ShapeDtypeStruct(q.shape, jnp.float32)))
    with pytest.raises(Exception, match="1, 2, 3, 4 or 8 query heads per key head"):
        jax.block_until_ready(call(q, cache.k, cache.v, jnp.int32(0), ctx.pages, ctx.cached, jnp.zeros(1, jnp.int32),
                                   softcap=np.float32(0)))
