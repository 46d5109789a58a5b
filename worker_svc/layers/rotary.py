"""Rotary position embedding (Su et al., 2021), in the half-split layout Hugging Face Llama uses:
the first half of each head's dimensions pairs with the second half. Optionally with Llama 3.1's
frequency-dependent scaling of the rotation frequencies (rope_type `llama3`), a linear one (`linear`),
or YaRN's (rope_type `yarn`, GPT-OSS), which also scales cos and sin by its attention factor; for a
model whose layers rotate by different bases, one per kind of layer (LayerRopes)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's long-context rotary (Hugging Face's `_compute_llama3_parameters`): frequencies
    whose wavelength exceeds original_max_position_embeddings / low_freq_factor turn `factor` times
    slower, those under original / high_freq_factor stay, and those between are interpolated
    smoothly; no attention scaling. The config's `rope_scaling` dict, its numbers as fields."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __call__(self, inv_freq: jax.Array) -> jax.Array:  # [H/2] -> [H/2]
        old = self.original_max_position_embeddings
        low_freq_wavelen, high_freq_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return jnp.where(medium, smoothed, scaled)


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (Peng et al., 2023) as Hugging Face's `_compute_yarn_parameters` computes it: each
    frequency is blended between itself (extrapolated) and itself / factor (interpolated) by a linear
    ramp over the frequency index, from `low` (below: kept) to `high` (above: interpolated); and
    `attention_factor`, by which cos and sin are multiplied (so every score by its square). Build it
    with `of`, from the config's rope parameters; the fields are what the rotary needs."""

    factor: float
    low: float  # the correction range over the H/2 frequency indices
    high: float
    attention_factor: float

    @classmethod
    def of(cls, rope: dict, head_dim: int, theta: float) -> "YarnScaling":
        """From a config's rope parameters (factor, original_max_position_embeddings; beta_fast,
        beta_slow, truncate, attention_factor, mscale, mscale_all_dim where given), as transformers
        reads them."""
        factor, original = float(rope["factor"]), int(rope["original_max_position_embeddings"])

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = rope.get("attention_factor")
        if attention is None:
            m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
            attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

        def correction_dim(rotations: float) -> float:  # the frequency index making `rotations` turns over `original`
            return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(rope.get("beta_fast") or 32), correction_dim(rope.get("beta_slow") or 1)
        if rope.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        return cls(factor, max(low, 0), min(high, head_dim - 1), float(attention))

    def __call__(self, inv_freq: jax.Array) -> jax.Array:  # [H/2] -> [H/2]
        high = self.high + 0.001 if self.low == self.high else self.high  # transformers' guard against a zero range
        ramp = jnp.clip((jnp.arange(inv_freq.shape[0], dtype=jnp.float32) - self.low) / (high - self.low), 0, 1)
        extrapolated = 1 - ramp
        return (inv_freq / self.factor) * (1 - extrapolated) + inv_freq * extrapolated


class Rope:
    """cos and sin for a step's positions, computed once and shared by every layer."""

    def __init__(self, positions: jax.Array, head_dim: int, theta: float,
                 scaling: Llama3Scaling | LinearScaling | YarnScaling | None = None) -> None:
        inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)  # [H/2]
        if scaling is not None:
            inv_freq = scaling(inv_freq)
        angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
        self.cos, self.sin = jnp.cos(angles), jnp.sin(angles)
        if isinstance(scaling, YarnScaling):  # as transformers: q and k rotated and scaled by the factor
            self.cos, self.sin = self.cos * scaling.attention_factor, self.sin * scaling.attention_factor

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [T, heads, H] -> x rotated by each token's position."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
        cos, sin = self.cos[:, None, :], self.sin[:, None, :]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


@dataclass(frozen=True)
class LinearScaling:
    """Position interpolation (rope_type `linear`, Hugging Face's `_compute_linear_scaling_rope_parameters`):
    every frequency `factor` times slower, as if positions were divided by it; no attention scaling.
    Gemma 3's global layers (factor 8 from 4B up)."""

    factor: float

    def __call__(self, inv_freq: jax.Array) -> jax.Array:  # [H/2] -> [H/2]
        return inv_freq / self.factor


class LayerRopes:
    """Rotary whose base and scaling differ by layer (Gemma 3: its local layers one, its global
    layers another). Each kind's cos and sin are computed once per step, as Rope's are, and a layer
    picks its kind's by its index, traced inside the layer scan: the kind is data, so a stack of
    mixed layers is still one scanned body, compiled once."""

    def __init__(self, ropes: Sequence[Rope], kinds: Sequence[int]) -> None:
        """`ropes`: one per kind; `kinds`: each layer's, an index into `ropes`."""
        self.cos = jnp.stack([rope.cos for rope in ropes])  # [kinds, T, H/2]
        self.sin = jnp.stack([rope.sin for rope in ropes])
        self.kinds = tuple(kinds)  # [L], static

    def at(self, layer: jax.Array) -> Rope:
        """The rotary of layer `layer` (a traced index)."""
        kind = jnp.asarray(self.kinds, jnp.int32)[layer]
        return _Picked(self.cos[kind], self.sin[kind])


class _Picked(Rope):
    """A Rope of cos and sin already computed (LayerRopes.at)."""

    def __init__(self, cos: jax.Array, sin: jax.Array) -> None:
        self.cos, self.sin = cos, sin
