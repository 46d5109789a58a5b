"""Decode's bytes read per cached token and layer, multi-head latent attention's absorbed form against the
expanded one, at DeepSeek-V3's sizes (128 heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim
128, v_head_dim 128) and a bfloat16 cache.

- absorbed (served, layers/mla.py): one decode token's queries attend the paged latent cache [L, P, Z,
  1, R + Dr] as multi-query attention, each cached token read once (R + Dr numbers) for all heads;
- expanded: the same token over a cache of every head's keys [N, Dn + Dr] and values [N, Dv], what
  standard attention reads for MLA's numbers (transformers' eager path expands the latent to these).

Measured in what XLA compiles: layers/attention.py's paged_attention for one decode token over a
context of pairs (one PAIR_CHUNK of 128 pages of Z tokens), its gathers of cache pages (after XLA's
common-subexpression elimination: the latent, keys and values at once, is gathered once) counted in
elements, times the cache's item size, per position read. Shapes only: nothing is allocated.

    python -m benchmarks.mla_bytes
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp

from worker_svc.layers.attention import paged_attention
from worker_svc.layers.ordered_attention import PAIR_CHUNK
from worker_svc.layers.paged import KVCache, PagedContext

HEADS, RANK, ROPE, NOPE, V_DIM = 128, 512, 64, 128, 128
PAGE, PAGES = 16, PAIR_CHUNK  # Z, and pages the context spans (one chunk of pairs)
CACHE = jnp.bfloat16


def gathered_per_position(query: int, keys: tuple[int, int], values: tuple[int, int]) -> float:
    """Cache bytes the compiled decode attention gathers per cached position: queries [1, N, query], a cache
    of keys [K, Hk] and values [K, Hv] per token (one array, keys and values, where the two are equal: the latent)."""
    shape = jax.ShapeDtypeStruct
    q = shape((1, HEADS, query), jnp.float32)
    k, v = shape((1, *keys), jnp.float32), shape((1, *values), jnp.float32)
    latent = keys == values
    cache_k = shape((1, PAGES + 1, PAGE, *keys), CACHE)
    cache = KVCache(cache_k, None if latent else shape((1, PAGES + 1, PAGE, *values), CACHE))
    ctx = jax.tree.map(lambda a: shape(a.shape, a.dtype), PagedContext.padded(1, PAGES))

    def attend(q, k, v, cache, ctx):
        view = KVCache(cache.k, cache.k) if latent else cache  # the latent is keys and values: one array
        return paged_attention(q, k, k if latent else v, view, jnp.int32(0), ctx)

    text = jax.jit(attend).lower(q, k, v, cache, ctx).compile().as_text()
    pages = {f"slice_sizes={{1,1,{PAGE},{a},{b}}}" for a, b in (keys, values)}  # a gather of whole cache pages
    gathered = [line.split("=")[1].split("]")[0].split("[")[1] for line in text.splitlines()
                if " gather(" in line and any(p in line for p in pages)]
    elements = sum(math.prod(int(n) for n in dims.split(",")) for dims in gathered)
    return elements * jnp.dtype(CACHE).itemsize / (PAGES * PAGE)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    absorbed = gathered_per_position(RANK + ROPE, (1, RANK + ROPE), (1, RANK + ROPE))
    expanded = gathered_per_position(NOPE + ROPE, (HEADS, NOPE + ROPE), (HEADS, V_DIM))
    print(f"decode attention's cache bytes gathered per cached token and layer (compiled HLO, {jnp.dtype(CACHE).name} "
          f"cache, DeepSeek-V3's sizes): absorbed {absorbed:,.0f}, expanded {expanded:,.0f} ({expanded / absorbed:.1f}x); "
          f"61 layers: {61 * absorbed / 1e3:,.1f} KB against {61 * expanded / 1e6:,.2f} MB a token")


if __name__ == "__main__":
    main()
