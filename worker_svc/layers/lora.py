"""Batched multi-LoRA (Hu et al., 2021): a fixed number of adapter slots over the base model, any mix
of adapters and base rows in one compiled step.

Each targeted projection p (q, k, v, o of attention; gate, up, down of the dense MLP) has, per layer,
stacked slot arrays A [S, Din, r] and B [S, r, Dout] (S slots of rank up to r = worker.lora.max_rank,
zero-padded past each adapter's own rank: the padded columns add nothing) and a scale per slot
(alpha / rank, or alpha / sqrt(rank) for rsLoRA). A step's token carries its slot (-1: the base model),
and the projection's output gains

    delta[t] = (x[t] @ A[slot[t]]) @ B[slot[t]] * scale[slot[t]]        (0 for slot -1)

computed grouped by slot: the tokens sorted by slot, two `jax.lax.ragged_dot`s over the groups (the
base rows sort last, past every group, and get zeros), unsorted; a step of base rows alone skips the
products. Which projections: the names in ADAPTED of a layer's own Attention and dense MLP, the
modules whose calls pass the hook (`adapted_paths`). The slot arrays keep their shapes
whatever is loaded: loading or clearing an adapter writes a slot's rows between steps, and nothing
recompiles (adapters.py holds them on the device).

Not parameters: the arrays travel beside the model's, in the step's PagedContext (`lora`), so the
checkpoint loader, the hot swap and the weight names never see them. Experts are never adapted (an
adapter of one is refused by name: adapters.py).

Shapes in the legend of worker_svc/__init__.py; S adapter slots, r their rank (max_rank).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.numerics import Numerics

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # our names of the projections an adapter may target


class LoraStep(NamedTuple):
    """What a step's layers read of the adapters: every targeted projection's stacked slot arrays,
    a scale per slot, and each token's slot."""

    a: dict[str, jax.Array]  # name -> [L, S, Din, r]
    b: dict[str, jax.Array]  # name -> [L, S, r, Dout]
    scale: jax.Array  # [S] f32; 0 for an empty slot
    slot: jax.Array  # [T] i32: each token's slot; -1: the base model alone


def adapted_paths(model: nnx.Module) -> set[tuple[str, ...]]:
    """The parameter paths (stack, module, weight) of the projections that call `adapted`: the weights
    named in ADAPTED by a layer's own attention or MLP module (a module nested deeper, as DeepSeek's
    shared experts' SwiGLU, is called without the adapters; latent attention has no ADAPTED)."""
    return {(*map(str, path), name) for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Module) and len(path) == 2 for name in getattr(type(node), "ADAPTED", ())}


def adapted(lora: LoraStep | None, name: str, layer: jax.Array, x: jax.Array, y: jax.Array, numerics: Numerics) -> jax.Array:
    """The hook every targeted projection calls: its output y [T, ...] (of x [T, ...]) plus the
    adapters' delta, reshaped to y's shape; y itself where no adapter is served or `name` is not targeted.
    Under `numerics.batch_invariant` the delta is `gathered_delta` in the mode's row tiles: the ragged
    matmul's groups follow the batch (its sizes, a row's place among the sorted rows), a tile's rows
    each multiply their own gathered A and B, in one compiled shape whatever the step."""
    if lora is None or name not in lora.a:
        return y
    a, b = lora.a[name][layer], lora.b[name][layer]  # [S, Din, r], [S, r, Dout]
    flat = x.reshape(x.shape[0], -1)

    def tiled(x: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array, slot: jax.Array) -> jax.Array:
        return numerics.rowwise(lambda x, slot: gathered_delta(x, a, b, scale, slot), x, slot)

    delta = tiled if numerics.batch_invariant else grouped_delta
    # A step of base rows alone (every slot -1) skips the products: a served adapter costs such steps nothing.
    # A base row's delta is a signed zero either way (its scale 0), so its sum with y is y, bit for bit.
    out = jax.lax.cond(jnp.any(lora.slot >= 0), delta, lambda x, a, b, *_: jnp.zeros((x.shape[0], b.shape[-1]), jnp.float32),
                       flat, a, b, lora.scale, lora.slot)
    return y + out.reshape(y.shape).astype(y.dtype)


def grouped_delta(x: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array, slot: jax.Array) -> jax.Array:
    """x [T, Din] -> the delta [T, Dout] f32, each token through its own slot's A and B (a ragged
    matmul over the tokens sorted by slot; a slot-(-1) token, sorted past every group: zeros)."""
    slots = a.shape[0]
    key = jnp.where(slot >= 0, slot, slots)  # the base rows last
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=slots + 1)[:slots].astype(jnp.int32)  # [S]: rows per slot; the base rows in none
    h = jax.lax.ragged_dot(x[order], a.astype(x.dtype), sizes, preferred_element_type=jnp.float32)  # [T, r]
    out = jax.lax.ragged_dot(h.astype(x.dtype), b.astype(x.dtype), sizes, preferred_element_type=jnp.float32)  # [T, Dout]
    out = jnp.zeros_like(out).at[order].set(out)
    return out * jnp.where(slot >= 0, scale[jnp.clip(slot, 0, slots - 1)], 0.0)[:, None]


def gathered_delta(x: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array, slot: jax.Array) -> jax.Array:
    """grouped_delta's numbers by a gather of each token's A and B ([T, Din, r], [T, r, Dout]): each
    row a product of its own, whatever the others (batch_invariant's way: `adapted`)."""
    slots = a.shape[0]
    at = jnp.clip(slot, 0, slots - 1)
    h = jnp.einsum("TI,TIR->TR", x, a[at].astype(x.dtype), preferred_element_type=jnp.float32)
    out = jnp.einsum("TR,TRO->TO", h.astype(x.dtype), b[at].astype(x.dtype), preferred_element_type=jnp.float32)
    return out * jnp.where(slot >= 0, scale[at], 0.0)[:, None]
