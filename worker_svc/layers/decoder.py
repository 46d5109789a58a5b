"""What every decoder-only model here shares around its decoder layer: the token embedding, the
layers stacked along a leading `layers` axis and run with `jax.lax.scan` (one compiled layer body
serves every depth, so compile time does not grow with the layer count), the final RMSNorm, and
an LM head tied to the embedding or not. A model file defines its layer and passes a maker.

Legend: T tokens, R sampled rows, D model dim, K kv heads, H head dim, L layers, V vocab.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.attention import KVCache, PagedContext
from worker_svc.layers.embedding import Embed, LMHead
from worker_svc.layers.norms import RMSNorm
from worker_svc.layers.rotary import Rope


class Decoder(nnx.Module):
    """cfg: vocab, dim, layers, head_dim, rope_theta, norm_eps, tie_embeddings. make_layer(rngs)
    builds one layer, called as layer(x, rope, cache, index, ctx) -> (x, k, v)."""

    def __init__(self, cfg: Any, make_layer: Callable[[nnx.Rngs], nnx.Module], *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.embed = Embed(cfg.vocab, cfg.dim, dtype=dtype, rngs=rngs)

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked(rngs: nnx.Rngs) -> nnx.Module:
            return make_layer(rngs)

        self.layers = stacked(rngs)  # every parameter has a leading [L] axis
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=dtype)
        self.lm_head = None if cfg.tie_embeddings else LMHead(cfg.dim, cfg.vocab, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array, ctx: PagedContext, cache: KVCache, sample_at: jax.Array):
        """tokens [T] -> (logits [R, V] f32 at the tokens `sample_at` [R], the final normed hidden
        states [T, D] (for `head` to score prompt tokens), new keys and values [L, T, K, H] for the
        caller to write into the cache after this read-only pass)."""
        rope = Rope(ctx.positions, self.cfg.head_dim, self.cfg.rope_theta)
        graph, params = nnx.split(self.layers)

        def body(x, scanned):
            index, layer_params = scanned
            x, k, v = nnx.merge(graph, layer_params)(x, rope, cache, index, ctx)
            return x, (k, v)

        x = self.embed(tokens)  # [T, D]
        x, (k, v) = jax.lax.scan(body, x, (jnp.arange(self.cfg.layers), params))
        h = self.norm(x)  # [T, D]
        return self.head(jnp.take(h, sample_at, axis=0)), h, k, v

    def head(self, h: jax.Array) -> jax.Array:
        """Final normed hidden states [N, D] -> logits [N, V] f32."""
        return self.embed.attend(h) if self.lm_head is None else self.lm_head(h)
