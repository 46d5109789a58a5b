"""Multi-head latent attention (DeepSeek-V2, DeepSeek-AI 2024; DeepSeek-V3), over a latent paged cache.

Per token, the keys and values of every head come from one compressed vector: kv_a projects x to a
latent c [R] (kv_lora_rank, then RMS-normed) and a rotary key k_pe [Dr] (qk_rope_head_dim) shared by
the heads; kv_b's W_UK [R, N, Dn] and W_UV [R, N, Dv] would expand c into each head's key (beside
k_pe) and value. The query: q [N, Dn + Dr] from x directly (`q_lora_rank` null) or through a
low-rank q_a [D, Rq], its RMSNorm and q_b; its last Dr dimensions rotate (decoupled rotary), its
first Dn meet W_UK's keys. The cache holds each token's [c, k_pe] alone, R + Dr numbers (576 for
DeepSeek-V3, against 2 x 128 heads x 192 expanded), in one paged array "k" [L, P, Z, 1, R + Dr]
(layers/paged.py's CacheSpec.latent): no "v".

Attention reads the latent in the absorbed form: W_UK folds into the query (q_latent = q_nope W_UK^T,
[N, R]), so a head's score over a cached token is [q_latent, q_pe] . [c, k_pe], one key head of
dimension R + Dr shared by all N query heads (multi-query attention, G = N); the values are that key's
first R columns, and W_UV applies to the attended latent, per head, before o. So every way the cache
is read (page lists, pairs, ordered_attention under batch_invariant: layers/attention.py,
ordered_attention.py) runs unchanged on a view of the latent array as both keys and values (one array:
one gather), and the output's last Dr columns are dropped.

The step's own keys attend in the same absorbed form, not expanded per head: one softmax over the
cache and the step in one space, and ordered_attention lays a page's fresh keys over its cached ones
in the same pass, which needs them in the cache's form. Expanding would cost fewer multiplies in a
long prefill (Dn + Dr against R + Dr per score); that trade is not taken here.

The CPU attention kernel reads keys and values per KV head of its own head dimensions: it is not
handed MLA's (the engine logs it, engine.py); the products (q_a, q_b, kv_a, o) take the kernels as
any matmul does.

Rotary: DeepSeek lays q_pe and k_pe out in interleaved pairs (x0, x1), (x2, x3), ... where
`interleaved` (V3's rope_interleave, V2 always): they are de-interleaved to the half-split layout
before the rotation, as transformers' apply_rotary_pos_emb_interleave does (V2's complex product
keeps the pairs interleaved after it; a score is the same under any permutation both sides share).

Shapes in the legend of worker_svc/__init__.py; R kv_lora_rank, Dr qk_rope_head_dim, Dn qk_nope_head_dim,
Dv v_head_dim, Rq q_lora_rank (C, a low-rank axis, in the einsums).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.attention import paged_attention
from worker_svc.layers.norms import RMSNorm
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.ordered_attention import ordered_attention
from worker_svc.layers.paged import KVCache, PagedContext
from worker_svc.layers.quantized import QArray, weight
from worker_svc.layers.rotary import Rope


class MLA(nnx.Module):
    """`q_lora_rank` None: q [D, N, Dn + Dr] directly; else q_a [D, Rq], q_a_norm, q_b [Rq, N, Dn + Dr].
    `scale`: the scores' (DeepSeek's softmax_scale). `norm_eps`: q_a_norm's and kv_a_norm's."""

    IN_PLACE = ("q", "q_a", "q_b", "kv_a", "o")  # read in place in their stack by a kernel (stack_layer.py); kv_b is sliced

    def __init__(self, dim: int, heads: int, *, q_lora_rank: int | None, kv_lora_rank: int, nope_dim: int, rope_dim: int,
                 v_dim: int, norm_eps: float, scale: float, interleaved: bool, numerics: Numerics = Numerics(),
                 dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.numerics = numerics
        int8, qk_dim = numerics.quantization, nope_dim + rope_dim
        if q_lora_rank is None:
            self.q = weight(rngs, (dim, heads, qk_dim), dim**-0.5, ("embed", "heads", "head_dim"), (0,), dtype, int8)  # [D, N, Dn + Dr]
            self.q_a = self.q_a_norm = self.q_b = None
        else:
            self.q = None
            self.q_a = weight(rngs, (dim, q_lora_rank), dim**-0.5, ("embed", None), (0,), dtype, int8)  # [D, Rq]
            self.q_a_norm = RMSNorm(q_lora_rank, norm_eps, numerics=numerics, dtype=dtype)
            self.q_b = weight(rngs, (q_lora_rank, heads, qk_dim), q_lora_rank**-0.5, (None, "heads", "head_dim"), (0,), dtype,
                              int8)  # [Rq, N, Dn + Dr]
        self.kv_a = weight(rngs, (dim, kv_lora_rank + rope_dim), dim**-0.5, ("embed", None), (0,), dtype, int8)  # [D, R + Dr]
        self.kv_a_norm = RMSNorm(kv_lora_rank, norm_eps, numerics=numerics, dtype=dtype)
        self.kv_b = weight(rngs, (kv_lora_rank, heads, nope_dim + v_dim), kv_lora_rank**-0.5, (None, "heads", "head_dim"), (0,),
                           dtype, int8)  # [R, N, Dn + Dv]: W_UK, then W_UV
        self.o = weight(rngs, (heads, v_dim, dim), (heads * v_dim)**-0.5, ("heads", "head_dim", "embed"), (0, 1), dtype, int8)  # [N, Dv, D]
        self.rank, self.nope_dim, self.scale, self.interleaved = kv_lora_rank, nope_dim, scale, interleaved

    def __call__(self, x: jax.Array, rope: Rope, cache: KVCache, layer: jax.Array, ctx: PagedContext) -> tuple[jax.Array, jax.Array]:
        """x [T, D] -> (output [T, D], this step's latent entries [T, 1, R + Dr] to write)."""
        matmul, rank, nope = self.numerics.matmul, self.rank, self.nope_dim
        if self.q is not None:
            q = matmul("TD,DNH->TNH", x, self.q[...])
        else:
            q = matmul("TC,CNH->TNH", self.q_a_norm(matmul("TD,DC->TC", x, self.q_a[...])), self.q_b[...])  # [T, N, Dn + Dr]
        kv = matmul("TD,DC->TC", x, self.kv_a[...])  # [T, R + Dr]
        latent = self.kv_a_norm(kv[:, :rank])  # [T, R]
        q_pe, k_pe = self._rotated(rope, q[..., nope:]), self._rotated(rope, kv[:, None, rank:])  # [T, N, Dr], [T, 1, Dr]
        entry = jnp.concatenate([latent[:, None, :], k_pe.astype(latent.dtype)], axis=-1)  # [T, 1, R + Dr]
        w = self.kv_b[...]
        q_latent = matmul("TNH,CNH->TNC", q[..., :nope], _columns(w, 0, nope))  # W_UK folded into the query: [T, N, R]
        query = jnp.concatenate([q_latent, q_pe.astype(q_latent.dtype)], axis=-1)  # [T, N, R + Dr]
        view = KVCache(cache.k, cache.k)  # the latent is every head's key, its first R columns the value
        if self.numerics.batch_invariant:
            out = ordered_attention(query, entry, entry, view, layer, ctx, scale=self.scale)
        else:
            out = paged_attention(query, entry, entry, view, layer, ctx, scale=self.scale)
        out = matmul("TNC,CNH->TNH", out[..., :rank], _columns(w, nope, w.shape[-1]))  # W_UV: [T, N, Dv]
        return matmul("TNH,NHD->TD", out, self.o[...]), entry

    def _rotated(self, rope: Rope, x: jax.Array) -> jax.Array:
        """x [T, heads, Dr] rotated, de-interleaved first where the checkpoint lays its pairs out interleaved."""
        if self.interleaved:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return rope(x)


def _columns(w: jax.Array | QArray, start: int, stop: int) -> jax.Array | QArray:
    """w [R, N, Dn + Dv]'s last-axis columns start:stop (an int8 weight's scale has them too: one per output channel)."""
    if isinstance(w, QArray):
        return QArray(w.values[..., start:stop], w.scale[..., start:stop])
    return w[..., start:stop]
