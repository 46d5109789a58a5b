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
        # The mean of squares in float32 whatever the activation dtype: bf16 loses the small terms.
        dtype = x.dtype if dtype is None else dtype
        scale = self.scale[...].astype(dtype)

        def norm(rows: jax.Array) -> jax.Array:
            x32 = rows.astype(jnp.float32)
            normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
            return normed.astype(dtype) * scale

        return self.numerics.rowwise(norm, x)
