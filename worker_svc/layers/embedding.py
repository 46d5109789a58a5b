"""Token embedding, and the LM head that shares its table when the checkpoint ties them. Under
`numerics.lm_head_fp32` the head multiplies float32 hidden states by its weights in float32.
Under int8 (quantized.py) the table has a scale per vocabulary row, which is both the unit a lookup
reads and the output channel of the tied head; an untied head one per vocabulary column.
Gemma scales what a lookup reads by sqrt(dim) (`scale`), the factor rounded to the model dtype as
transformers rounds it (bfloat16: sqrt(3072) = 55.43 becomes 55.5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from worker_svc.layers import quantized
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.quantized import QArray, weight


def _head_inputs(x: jax.Array, w: jax.Array | QArray, numerics: Numerics) -> tuple[jax.Array, jax.Array | QArray]:
    if not numerics.lm_head_fp32:
        return x, w
    # int8 values are converted to the hidden states' dtype in the product: float32 here.
    return x.astype(jnp.float32), (w if isinstance(w, QArray) else w.astype(jnp.float32))


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, scale: float | None = None, numerics: Numerics = Numerics(), dtype: jnp.dtype,
                 rngs: nnx.Rngs) -> None:
        self.table = weight(rngs, (vocab, dim), 0.02, ("vocab", "embed"), (1,), dtype, numerics.quantization)  # [V, D]
        self.scale = scale  # None: rows as the table holds them; the tied head reads the table unscaled either way
        self.numerics = numerics
        self.dtype = dtype

    def __call__(self, tokens: jax.Array) -> jax.Array:
        rows = quantized.take(self.table[...], tokens, self.dtype)  # [T] -> [T, D]
        return rows if self.scale is None else rows * jnp.asarray(self.scale, self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied LM head: logits against every embedding row, accumulated in float32."""
        x, table = _head_inputs(x, self.table[...], self.numerics)
        return self.numerics.matmul("RD,VD->RV", x, table, preferred_element_type=jnp.float32)


class LMHead(nnx.Module):
    """An untied output projection."""

    def __init__(self, dim: int, vocab: int, *, numerics: Numerics = Numerics(), dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.w = weight(rngs, (dim, vocab), dim**-0.5, ("embed", "vocab"), (0,), dtype, numerics.quantization)  # [D, V]
        self.numerics = numerics

    def __call__(self, x: jax.Array) -> jax.Array:
        x, w = _head_inputs(x, self.w[...], self.numerics)
        return self.numerics.matmul("RD,DV->RV", x, w, preferred_element_type=jnp.float32)
