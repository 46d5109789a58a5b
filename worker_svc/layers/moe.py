"""Mixture of experts (Shazeer et al., 2017), as Qwen3-MoE and Mixtral use it: a router scores every
expert for each token, the top k are kept, and the token's output is the routing-weighted sum of those
experts' SwiGLU MLPs.

Two strategies compute the same sum, chosen by the config's `moe.strategy`:

- `fused`: every token through every expert densely, combined with weights that are zero off the
  token's top k. E / k times the needed FLOPs, but only plain einsums: simple, for few experts.
- `ep`: the (token, choice) assignments sorted by expert, so each expert's rows are contiguous, and run
  through grouped matmuls (`jax.lax.ragged_dot`), then unsorted and combined. Only the chosen experts'
  FLOPs. The sorted rows with their group sizes are what an all-to-all would send when the expert axis
  is sharded over devices (each device receiving its own experts' groups), and the unsort is the
  return trip; on one device there is no exchange.

Legend: T tokens, D model dim, E experts, F expert mlp dim, k experts per token, A = T * k assignments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

STRATEGIES = ("fused", "ep")


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, names: tuple[str, ...], dtype: jnp.dtype) -> nnx.Param:
    w = jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in**-0.5
    return nnx.Param(w.astype(dtype), out_sharding=names, eager_sharding=False)


class Router(nnx.Module):
    """Softmax over all E experts in float32, then the top k; with `norm_topk_prob` the k weights are
    renormalized to sum to 1 (Qwen3-MoE's released models), else they stay the softmax's own."""

    def __init__(self, dim: int, experts: int, top_k: int, norm_topk_prob: bool, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.w = _param(rngs, (dim, experts), dim, ("embed", "expert"), dtype)  # [D, E]
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [T, D] -> (weights [T, k] in x's dtype, chosen experts [T, k] i32, best first)."""
        logits = jnp.einsum("TD,DE->TE", x, self.w[...], preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)  # [T, E] f32
        weights, chosen = jax.lax.top_k(probs, self.top_k)  # ties go to the lower expert index, as torch.topk's do
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdims=True)
        return weights.astype(x.dtype), chosen


class Experts(nnx.Module):
    """E SwiGLU MLPs, stacked on a leading `expert` axis (the axis expert parallelism shards)."""

    def __init__(self, dim: int, hidden: int, experts: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.gate = _param(rngs, (experts, dim, hidden), dim, ("expert", "embed", "mlp"), dtype)  # [E, D, F]
        self.up = _param(rngs, (experts, dim, hidden), dim, ("expert", "embed", "mlp"), dtype)  # [E, D, F]
        self.down = _param(rngs, (experts, hidden, dim), hidden, ("expert", "mlp", "embed"), dtype)  # [E, F, D]

    def fused(self, x: jax.Array, weights: jax.Array, chosen: jax.Array) -> jax.Array:
        """x [T, D], weights and chosen [T, k] -> [T, D]: every expert on every token."""
        num_experts = self.gate.shape[0]
        # Each token's weight for every expert: its routing weight where chosen, 0 elsewhere.
        combine = jnp.einsum("Tk,TkE->TE", weights, jax.nn.one_hot(chosen, num_experts, dtype=weights.dtype))
        gate = jnp.einsum("TD,EDF->TEF", x, self.gate[...])
        up = jnp.einsum("TD,EDF->TEF", x, self.up[...])
        hidden = jax.nn.silu(gate) * up * combine[:, :, None]  # [T, E, F]: rows of unchosen experts are 0
        return jnp.einsum("TEF,EFD->TD", hidden, self.down[...])

    def grouped(self, x: jax.Array, weights: jax.Array, chosen: jax.Array) -> jax.Array:
        """x [T, D], weights and chosen [T, k] -> [T, D]: each token through its k experts only."""
        num_tokens, top_k = chosen.shape
        num_experts = self.gate.shape[0]
        # Dispatch: the A = T*k assignments, flattened token-major, stably sorted by expert, so expert
        # e's rows are the group_sizes[e] contiguous rows after those of experts < e (ragged_dot's layout).
        expert_of = chosen.reshape(-1)  # [A]
        order = jnp.argsort(expert_of, stable=True)  # [A]: sorted row -> assignment
        rows = jnp.take(x, order // top_k, axis=0)  # [A, D]: assignment a belongs to token a // k
        group_sizes = jnp.bincount(expert_of, length=num_experts).astype(jnp.int32)  # [E]
        gate = jax.lax.ragged_dot(rows, self.gate[...], group_sizes)  # [A, F]
        up = jax.lax.ragged_dot(rows, self.up[...], group_sizes)  # [A, F]
        out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, self.down[...], group_sizes)  # [A, D]
        # Combine: the inverse permutation puts each row back at its (token, choice) assignment.
        out = jnp.take(out, jnp.argsort(order), axis=0).reshape(num_tokens, top_k, -1)  # [T, k, D]
        return jnp.einsum("TkD,Tk->TD", out, weights)


class MoE(nnx.Module):
    """x [T, D] -> [T, D]. `strategy` is "fused" or "ep" (see the module docstring)."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, *, norm_topk_prob: bool, strategy: str,
                 dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"MoE strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.router = Router(dim, experts, top_k, norm_topk_prob, dtype=dtype, rngs=rngs)
        self.experts = Experts(dim, hidden, experts, dtype=dtype, rngs=rngs)
        self.strategy = strategy

    def __call__(self, x: jax.Array) -> jax.Array:
        weights, chosen = self.router(x)  # [T, k], [T, k]
        if self.strategy == "fused":
            return self.experts.fused(x, weights, chosen)
        return self.experts.grouped(x, weights, chosen)
