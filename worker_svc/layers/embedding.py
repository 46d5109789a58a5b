"""Token embedding, and the LM head that shares its table when the checkpoint ties them. Under
`numerics.lm_head_fp32` the head multiplies float32 hidden states by its weights in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.numerics import Numerics


def _head_inputs(x: jax.Array, w: jax.Array, numerics: Numerics) -> tuple[jax.Array, jax.Array]:
    return (x.astype(jnp.float32), w.astype(jnp.float32)) if numerics.lm_head_fp32 else (x, w)


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, numerics: Numerics = Numerics(), dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        table = jax.random.normal(rngs.params(), (vocab, dim), jnp.float32) * 0.02
        self.table = nnx.Param(table.astype(dtype), out_sharding=("vocab", "embed"), eager_sharding=False)  # [V, D]
        self.numerics = numerics

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.table[...], tokens, axis=0)  # [T] -> [T, D]

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied LM head: logits against every embedding row, accumulated in float32."""
        x, table = _head_inputs(x, self.table[...], self.numerics)
        return self.numerics.matmul("RD,VD->RV", x, table, preferred_element_type=jnp.float32)


class LMHead(nnx.Module):
    """An untied output projection."""

    def __init__(self, dim: int, vocab: int, *, numerics: Numerics = Numerics(), dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        w = jax.random.normal(rngs.params(), (dim, vocab), jnp.float32) * dim**-0.5
        self.w = nnx.Param(w.astype(dtype), out_sharding=("embed", "vocab"), eager_sharding=False)  # [D, V]
        self.numerics = numerics

    def __call__(self, x: jax.Array) -> jax.Array:
        x, w = _head_inputs(x, self.w[...], self.numerics)
        return self.numerics.matmul("RD,DV->RV", x, w, preferred_element_type=jnp.float32)
