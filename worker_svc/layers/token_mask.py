"""A constrained row's token mask, applied to its logits before sampling (worker_svc/constrained.py
computes the masks on the host).

Its own small executable per rows bucket, run only for steps where some sampled row is constrained,
as the penalties are. A masked-out token's logit becomes -inf, as a token allowed_token_ids leaves
out: the default logprobs are over the tokens the constraint allows (docs/design.md).

Shapes in the legend of worker_svc/__init__.py; W = ceil(V / 32) mask words.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_token_mask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits [R, V], bitmask [R, W] int32 (token t allowed: bit t % 32 of word t // 32, llguidance's
    layout) -> logits [R, V] float32 with every token not allowed at -inf."""
    rows, vocab = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [R, W, 32]
    allowed = bits.reshape(rows, -1)[:, :vocab].astype(jnp.bool_)  # [R, V]
    return jnp.where(allowed, logits.astype(jnp.float32), -jnp.inf)
