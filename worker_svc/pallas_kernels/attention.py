"""Attention states by JAX's Pallas GPU kernels (jax.experimental.pallas.ops.gpu), in the running
softmax form the layers combine (layers/softmax_state.py): (max, sum, weighted values).

The cache: JAX's `paged_attention_kernel` (the body of gpu.paged_attention), called here through a
`pallas_call` of our own, for two reasons. Its public wrapper normalizes and drops the kernel's
(sum, max) residuals, which the layers need to combine the cache's state with the step's own keys'.
And it takes one layer's pages as [K, P, Z, H]; our cache is [L, P, Z, K, H], and slicing a layer
out (then moving K first) would copy the layer's cache for every layer of every step. Seen as
[L * P, Z, K, H] (a reshape that moves nothing), the block spec picks a KV head's [L * P, Z, H]
view where it lies, and each token's page table is offset by layer * P: the kernel gathers its
pages in place. Each token of the step is one row of the kernel (`vmap`), with its row's pages
and its cached length; a context splits into up to SPLITS partitions attended in parallel
(flash-decoding) whose states combine here.

The step's own keys: gpu.attention's `mha` (flash attention) over the step as one sequence, causal,
with the step's rows as segment ids: a step lays each row's tokens out contiguously in position
order (batch.py), so causal by index within a segment is causal by position within the row, and
padding (row -1) sees only padding. It returns the normalized output and the log-sum-exp (base 2), which is
the state (lse, 1, out). It needs whole blocks of tokens (OWN_MIN_TOKENS and a multiple of it) and
as many key heads as query heads (the step's keys repeated per group: a [T, N, H] copy, small).

Neither kernel takes a sliding window (the backend choice leaves such models to native:
worker_svc/attention_backend.py); the paged kernel soft-caps, the flash one does not (its part then
runs in jax.numpy). Sinks join after every source is combined (layers/attention.py), so any source
may come from a kernel.

Shapes in the legend of worker_svc/__init__.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas.ops.gpu import attention as flash
from jax.experimental.pallas.ops.gpu import paged_attention as paged

from worker_svc.layers.softmax_state import State

BLOCK_H = 16  # query heads per kernel block (the kernel's minimum: a group is padded up to it)
PAGES_PER_BLOCK = 8  # pages each inner iteration of the paged kernel gathers
SPLITS = 8  # partitions of a context attended in parallel (flash-decoding), at most
OWN_MIN_TOKENS = 16  # the flash kernel's smallest block of tokens (a Triton dot's least side)
LN2 = 0.6931471805599453


def applies(q_dtype, cache_dtype, head_dim: int) -> bool:
    """Whether the paged kernel reads a cache of `cache_dtype` for queries of `q_dtype`: the same
    float dtype (its dots take one), a head dimension a power of two from 16 (Triton's blocks)."""
    same = jnp.dtype(q_dtype) == jnp.dtype(cache_dtype) and jnp.dtype(q_dtype) in (jnp.float32, jnp.bfloat16)
    return same and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def cached_state(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, layer: jax.Array, pages: jax.Array,
                 cached: jax.Array, softcap: float | None, interpret: bool) -> State:
    """The State of queries q [T, K, G, H] (scaled) over each token's cached positions below
    cached[t], in its pages pages[t] of the cache [L, P, Z, K, H] at `layer`."""
    num_tokens, kv_heads, group, head_dim = q.shape
    layers, num_pages, page_size = cache_k.shape[:3]
    columns = pages.shape[1]
    per_block = min(PAGES_PER_BLOCK, columns)
    splits = min(SPLITS, -(-columns // per_block))
    width = -(-columns // (splits * per_block)) * splits * per_block  # the kernel's partitions hold whole blocks
    # Padding columns name the layer's page 0, never read: the kernel stops at each token's length.
    table = jnp.pad(pages, ((0, 0), (0, width - columns))) + layer * num_pages
    padded = -(-group // BLOCK_H) * BLOCK_H
    q = jnp.pad(q, ((0, 0), (0, 0), (0, padded - group), (0, 0))).astype(cache_k.dtype)
    stacked = [c.reshape(layers * num_pages, page_size, kv_heads, head_dim) for c in (cache_k, cache_v)]
    one = functools.partial(_partitions, splits=splits, per_block=per_block, softcap=softcap, interpret=interpret)
    out, total, top = jax.vmap(one, (0, None, None, 0, 0))(q, *stacked, table, cached[:, None])  # [T, S, K, Gp, ...]
    # The partitions' states, combined: the last round of flash-decoding.
    best = top.max(axis=1)
    scale = jnp.exp(top - best[:, None])
    total = (total * scale).sum(axis=1)
    out = (out * scale[..., None]).sum(axis=1)
    return best[:, :, :group], total[:, :, :group], out[:, :, :group]


def _partitions(q, k_pages, v_pages, table, length, *, splits: int, per_block: int, softcap: float | None, interpret: bool):
    """One token's (weighted values [S, K, Gp, H], sum [S, K, Gp], max [S, K, Gp]) per partition:
    q [K, Gp, H], the stacked cache [L * P, Z, K, H], its page table [O'] and cached length [1]."""
    kv_heads, padded, head_dim = q.shape
    pages, page_size = k_pages.shape[:2]
    per_split = table.shape[0] // splits
    kernel = functools.partial(paged.paged_attention_kernel, num_heads=padded, pages_per_compute_block=per_block,
                               mask_value=paged.DEFAULT_MASK_VALUE, attn_logits_soft_cap=softcap)
    cache_spec = pl.BlockSpec((pages, page_size, None, head_dim), lambda h, i, s: (0, 0, h, 0))  # one KV head, in place
    return pl.pallas_call(
        kernel,
        grid=(kv_heads, padded // BLOCK_H, splits),
        in_specs=[pl.BlockSpec((None, BLOCK_H, head_dim), lambda h, i, s: (h, i, 0)), cache_spec, None, cache_spec, None,
                  pl.BlockSpec((per_split,), lambda h, i, s: (s,)), pl.BlockSpec((1,), lambda h, i, s: (0,))],
        out_specs=[pl.BlockSpec((None, None, BLOCK_H, head_dim), lambda h, i, s: (s, h, i, 0)),
                   pl.BlockSpec((None, None, BLOCK_H), lambda h, i, s: (s, h, i)),
                   pl.BlockSpec((None, None, BLOCK_H), lambda h, i, s: (s, h, i))],
        out_shape=[jax.ShapeDtypeStruct((splits, kv_heads, padded, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct((splits, kv_heads, padded), jnp.float32),
                   jax.ShapeDtypeStruct((splits, kv_heads, padded), jnp.float32)],
        interpret=interpret,
        compiler_params=paged.plgpu.CompilerParams(num_warps=8 if head_dim > 64 else 4, num_stages=2),
        name="jaxstream_paged_attention",
    )(q, k_pages, None, v_pages, None, table, length)


def own_applies(num_tokens: int, softcap: float | None) -> bool:
    """Whether the flash kernel attends a step of `num_tokens` tokens to its own keys: whole blocks
    of OWN_MIN_TOKENS, no soft-capping (it has none)."""
    return softcap is None and num_tokens >= OWN_MIN_TOKENS and num_tokens % OWN_MIN_TOKENS == 0


def own_state(q: jax.Array, k: jax.Array, v: jax.Array, segment: jax.Array, interpret: bool) -> State:
    """The State of queries q [T, K, G, H] (scaled) over this step's own keys and values [T, K, H],
    each token over its row's tokens (`segment` [T]) up to its own."""
    num_tokens, kv_heads, group, head_dim = q.shape
    heads = kv_heads * group
    # Query head n = key head n // G, as q's [K, G] axes flatten; the kernel pairs head n with key head n.
    k, v = (jnp.repeat(a, group, axis=1).reshape(1, num_tokens, heads, head_dim).astype(q.dtype) for a in (k, v))
    block = flash.BlockSizes(block_q=min(128, num_tokens), block_k=min(128, num_tokens))
    out, lse = flash.mha(q.reshape(1, num_tokens, heads, head_dim), k, v, segment[None, :], sm_scale=1.0, causal=True,
                         block_sizes=block, interpret=interpret, return_residuals=True)  # [1, T, N, H], [1, N, T]
    top = lse[0].T.reshape(num_tokens, kv_heads, group) * LN2  # the kernel's log-sum-exp is base 2
    return top, jnp.ones_like(top), out[0].reshape(num_tokens, kv_heads, group, head_dim).astype(jnp.float32)
