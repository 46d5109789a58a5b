"""RMSNorm: scale by the reciprocal root-mean-square over the model dimension (Zhang & Sennrich, 2019).

`offset` (Gemma's "(1 + w)" norm: offset 1.0): the normalized x is multiplied by offset + scale, the
sum and the product in float32, the checkpoint's w stored as it is (weights round-trip by name)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.numerics import Numerics


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, offset: float = 0.0, numerics: Numerics = Numerics(), dtype: jnp.dtype) -> None:
        # An offset norm's stand-in scale is 0 (offset + 0 = the identity, as 1 is for a plain one).
        self.scale = nnx.Param(jnp.full((dim,), 1.0 - offset, dtype), out_sharding=("norm",), eager_sharding=False)  # [D]
        self.eps, self.offset = eps, offset
        self.numerics = numerics

    def __call__(self, x: jax.Array, dtype: jnp.dtype | None = None) -> jax.Array:
        """x [..., D] -> [..., D] in `dtype` (None: x's)."""
        return rms_norm(x, self.scale[...], self.eps, self.numerics, dtype, offset=self.offset)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, numerics: Numerics = Numerics(), dtype: jnp.dtype | None = None, *,
             offset: float = 0.0) -> jax.Array:
    """x [..., D], scale [D] -> [..., D] in `dtype` (None: x's), times offset + scale; row-wise (numerics.rowwise)."""
    # The mean of squares in float32 whatever the activation dtype: bf16 loses the small terms.
    dtype = x.dtype if dtype is None else dtype
    scale = scale.astype(dtype) if offset == 0.0 else offset + scale.astype(jnp.float32)

    def norm(rows: jax.Array) -> jax.Array:
        x32 = rows.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return normed.astype(dtype) * scale if offset == 0.0 else (normed * scale).astype(dtype)

    return numerics.rowwise(norm, x)
