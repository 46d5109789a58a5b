"""Decode attention over the paged KV cache on XLA:CPU, by a kernel of our own (config worker.attention_kernel).

Why. A decode step at many rows reads every row's cached keys and values, in every layer: at 32
rows it is most of the step's bytes. layers/attention.py's page lists gather each token's pages
and attend them in jax.numpy; on XLA:CPU that ran well below the cache's read rate, the gathered
copy, the scores, the softmax and the weighted sum each its own pass (measured in
docs/performance.md). The kernel (attention_kernel.cc, an XLA FFI custom call) reads each
position's keys and values where they lie in the cache, once, and folds them into the token's
running softmax in registers, on XLA's intra-op threads.

Where. layers/attention.py's page-list layout (steps of up to worker.page_list_tokens tokens: by
default, every step where the kernel applies; batch.py's `Buckets.choose_page_lists`) hands it,
through the model's `Kernels` (layers/kernels.py; kernels.py here), the cached part of a step's
attention, a prefill chunk's over its prompt's earlier chunks too, and `own_state` the part over
the step's own keys (faster than layers/attention.py's tiles for a prefill of several prompts):
`cached_state` returns the running softmax state (max, sum, weighted values) of each token's
queries over its row's cached positions, which `paged_attention` combines with the state over the
step's own keys. It applies to float32 queries over a float32 cache or a bfloat16 one held as
bits (layers/attention.py's `storage_dtype`), head dimensions 64 and 128, and 1, 2, 3, 4 or 8
query heads per key head (SmolLM2's, Qwen3's and Llama 3's groupings: each compiled instance adds
to the build's time), with a layer's sliding window (each token's lowest visible position: the pages
below it are never read) and soft-capping; otherwise `cached_state` returns None and the jax.numpy loop runs. Start-up
(worker_svc/start.py's `numerics`) turns it on only on the CPU platform and without a device mesh
(a custom call has no sharding rule); batch_invariant attends by ordered_attention, which never
reaches it. A custom call has no gradient: training's attention (batch_invariant's) does not use it.

Numbers. Scores, softmax and sums in float32, as the jax.numpy loop, in another order and with
its own exp (within ~2 float32 ulp): logprobs move by float32 rounding (tested against the loop).
A token's result depends on its own queries and context alone: the kernel cuts a context into
segments of fixed length and combines them in order, whatever the thread count or the step's
other tokens.

Building: build.py, once per process (`load`).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from worker_svc.cpu_kernels.build import CpuKernel

TARGET = "jaxstream_paged_decode"  # the XLA custom call targets: over the cache, over the step's own keys
OWN = "jaxstream_paged_own"
KERNEL = CpuKernel(Path(__file__).with_suffix(".cc"), {TARGET: "JaxstreamPagedDecode", OWN: "JaxstreamPagedOwn"})
HEAD_DIMS = (64, 128)  # compiled in attention_kernel.cc's segment_any
GROUPS = (1, 2, 3, 4, 8)  # query heads per key head, compiled likewise


def load() -> str:
    """Build (once per process) and register the kernel: "" when it is ready, else why not (one line)."""
    return KERNEL.load()


def applies(q_dtype, cache_dtype, group: int, head_dim: int) -> bool:
    """Whether the kernel reads a cache of `cache_dtype` for queries of `q_dtype`, `group` query heads
    per key head and head dimension `head_dim` (the module docstring's conditions)."""
    return (jnp.dtype(q_dtype) == jnp.float32 and jnp.dtype(cache_dtype) in (jnp.float32, jnp.uint16)
            and head_dim in HEAD_DIMS and group in GROUPS)


def cached_state(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, layer: jax.Array, pages: jax.Array,
                 cached: jax.Array, lowest: jax.Array | None = None,
                 softcap: float | None = None) -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """The (max [T, K, G], sum [T, K, G], weighted values [T, K, G, H]) state of queries q [T, K, G, H]
    (scaled) over each token's cached positions: its row's positions from lowest[t] (a sliding
    window's first; None: 0) up to cached[t], in pages pages[t] of the cache [L, P, Z, K, H] at
    `layer`, each score soft-capped by `softcap` where given. A token with nothing to read gets max
    -1e30 (layers/softmax_state.py's NEG_INF) and sums 0. None where the kernel does not apply
    (module docstring)."""
    tokens, kv_heads, group, head_dim = q.shape
    if (not applies(q.dtype, cache_k.dtype, group, head_dim) or cache_v.dtype != cache_k.dtype
            or cache_k.ndim != 5 or cache_k.shape[3:] != (kv_heads, head_dim)):
        return None
    heads = jax.ShapeDtypeStruct((tokens, kv_heads, group), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, (heads, heads, jax.ShapeDtypeStruct(q.shape, jnp.float32)), vmap_method="sequential")
    lowest = jnp.zeros_like(cached) if lowest is None else jnp.broadcast_to(lowest, cached.shape)
    return tuple(call(q, cache_k, cache_v, jnp.asarray(layer, jnp.int32), pages.astype(jnp.int32), cached.astype(jnp.int32),
                      lowest.astype(jnp.int32), softcap=np.float32(softcap or 0.0)))


def own_state(q: jax.Array, k: jax.Array, v: jax.Array, segment: jax.Array, window: jax.Array | None = None,
              softcap: float | None = None) -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """The (max, sum, weighted values) state of queries q [T, K, G, H] (scaled) over this step's own
    keys and values k, v [T, K, H] (as the cache will hold them, float32): each token's over its row's
    tokens in the step up to its own, a padding token's (row -1 in `segment` [T]) over itself alone.
    A step lays each row's tokens out contiguously in position order (batch.py), so a token's keys
    are those from its row's first in the step to its own: the kernel reads those alone, where the
    jax.numpy tiles score whole tiles of other rows and later positions to mask them. A sliding
    `window` w > 0 (traced) moves a token's first key to its w - 1th before it, if later; `softcap`
    caps each score. None where the kernel does not apply."""
    tokens, kv_heads, group, head_dim = q.shape
    if not applies(q.dtype, k.dtype, group, head_dim) or k.dtype != jnp.float32 or v.dtype != jnp.float32 or tokens == 0:
        return None
    index = jnp.arange(tokens, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones(1, bool), segment[1:] != segment[:-1]]) | (segment < 0)  # a row's first, or padding
    first = jax.lax.cummax(jnp.where(starts, index, 0))
    if window is not None:  # positions and indices advance together within a row
        first = jnp.where(window > 0, jnp.maximum(first, index - window + 1), first)
    heads = jax.ShapeDtypeStruct((tokens, kv_heads, group), jnp.float32)
    call = jax.ffi.ffi_call(OWN, (heads, heads, jax.ShapeDtypeStruct(q.shape, jnp.float32)), vmap_method="sequential")
    return tuple(call(q, k, v, first, index - first + 1, softcap=np.float32(softcap or 0.0)))
