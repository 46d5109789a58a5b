"""RMSNorm: scale by the reciprocal root-mean-square over the model dimension (Zhang & Sennrich, 2019)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.numerics import Numerics


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, numerics: Numerics = Numerics(), dtype: jnp.dtype) -> None:
        self.scale = nnx.Param(jnp.ones((dim,), dtype), out_sharding=("norm",), eager_sharding=False)  # [D]
        self.eps = eps
        self.numerics = numerics

    def __call__(self, x: jax.Array, dtype: jnp.dtype | None = None) -> jax.Array:
        """x [..., D] -> [..., D] in `dtype` (None: x's)."""
        return rms_norm(x, self.scale[...], self.eps, self.numerics, dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, numerics: Numerics = Numerics(), dtype: jnp.dtype | None = None) -> jax.Array:
    """x [..., D], scale [D] -> [..., D] in `dtype` (None: x's); row-wise (numerics.rowwise)."""
    # The mean of squares in float32 whatever the activation dtype: bf16 loses the small terms.
    dtype = x.dtype if dtype is None else dtype
    scale = scale.astype(dtype)

    def norm(rows: jax.Array) -> jax.Array:
        x32 = rows.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return normed.astype(dtype) * scale

    return numerics.rowwise(norm, x)
