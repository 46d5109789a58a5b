"""SwiGLU feed-forward (Shazeer, 2020): down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.numerics import Numerics


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, names: tuple[str, ...], dtype: jnp.dtype) -> nnx.Param:
    w = jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in**-0.5
    return nnx.Param(w.astype(dtype), out_sharding=names, eager_sharding=False)


class SwiGLU(nnx.Module):
    def __init__(self, dim: int, hidden: int, *, numerics: Numerics = Numerics(), dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.numerics = numerics
        self.gate = _param(rngs, (dim, hidden), dim, ("embed", "mlp"), dtype)  # [D, F]
        self.up = _param(rngs, (dim, hidden), dim, ("embed", "mlp"), dtype)  # [D, F]
        self.down = _param(rngs, (hidden, dim), hidden, ("mlp", "embed"), dtype)  # [F, D]

    def __call__(self, x: jax.Array) -> jax.Array:
        matmul = self.numerics.matmul
        gate = matmul("TD,DF->TF", x, self.gate[...])
        up = matmul("TD,DF->TF", x, self.up[...])
        return matmul("TF,FD->TD", jax.nn.silu(gate) * up, self.down[...])
