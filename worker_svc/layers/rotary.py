"""Rotary position embedding (Su et al., 2021), in the half-split layout Hugging Face Llama uses:
the first half of each head's dimensions pairs with the second half."""

from __future__ import annotations

import jax
import jax.numpy as jnp


class Rope:
    """cos and sin for a step's positions, computed once and shared by every layer."""

    def __init__(self, positions: jax.Array, head_dim: int, theta: float) -> None:
        inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)  # [H/2]
        angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
        self.cos, self.sin = jnp.cos(angles), jnp.sin(angles)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [T, heads, H] -> x rotated by each token's position."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
        cos, sin = self.cos[:, None, :], self.sin[:, None, :]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
