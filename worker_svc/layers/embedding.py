"""Token embedding, and the LM head that shares its table when the checkpoint ties them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        table = jax.random.normal(rngs.params(), (vocab, dim), jnp.float32) * 0.02
        self.table = nnx.Param(table.astype(dtype), out_sharding=("vocab", "embed"), eager_sharding=False)  # [V, D]

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.table[...], tokens, axis=0)  # [T] -> [T, D]

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied LM head: logits against every embedding row, accumulated in float32."""
        return jnp.einsum("RD,VD->RV", x, self.table[...], preferred_element_type=jnp.float32)


class LMHead(nnx.Module):
    """An untied output projection."""

    def __init__(self, dim: int, vocab: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        w = jax.random.normal(rngs.params(), (dim, vocab), jnp.float32) * dim**-0.5
        self.w = nnx.Param(w.astype(dtype), out_sharding=("embed", "vocab"), eager_sharding=False)  # [D, V]

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("RD,DV->RV", x, self.w[...], preferred_element_type=jnp.float32)
