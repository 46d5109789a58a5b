"""RMSNorm: scale by the reciprocal root-mean-square over the model dimension (Zhang & Sennrich, 2019)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype) -> None:
        self.scale = nnx.Param(jnp.ones((dim,), dtype), out_sharding=("norm",), eager_sharding=False)  # [D]
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        # The mean of squares in float32 whatever the activation dtype: bf16 loses the small terms.
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return normed.astype(x.dtype) * self.scale[...]
