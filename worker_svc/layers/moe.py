"""Mixture of experts (Shazeer et al., 2017), as Qwen3-MoE and Mixtral use it: a router scores every
expert for each token, the top k are kept, and the token's output is the routing-weighted sum of those
experts' SwiGLU MLPs.

Two strategies compute the same sum, chosen by the config's `moe.strategy`:

- `fused`: every token through every expert densely, combined with weights that are zero off the
  token's top k. E / k times the needed FLOPs, but only plain einsums: simple, for few experts.
- `ep`: the (token, choice) assignments sorted by expert, so each expert's rows are contiguous, and run
  through grouped matmuls (`jax.lax.ragged_dot`), then unsorted and combined. Only the chosen experts'
  FLOPs. When the config splits the experts over Q devices (`ExpertShards`, built by
  worker_svc/sharding.py from the `expert` rule), each device takes 1/Q of the step's tokens, sends
  each of their assignments to the device holding its expert (all-to-all), runs its own E/Q experts
  on what it received, sends the rows back (all-to-all) and combines its tokens' k rows; the tokens
  are then gathered on every device again.

Under a sharded `fused`, jit (GSPMD) splits the dense einsums by the same rules; no code here.

Shapes in the legend of worker_svc/__init__.py: here k experts per token, X = T * k assignments,
Q devices the experts are split over.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from worker_svc.layers import quantized
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.quantized import QArray, weight

STRATEGIES = ("fused", "ep")


class Routed(nnx.Intermediate):
    """What a MoE layer sows each call: its tokens' chosen experts [T, k] i32 (the router's order).
    Kept only by a caller that captures it (layers/decoder.py, for routed experts export, through
    `nnx.capture`); under a capture of nothing it is not kept and compiles to nothing."""


@dataclass(frozen=True)
class ExpertShards:
    """Where the experts' weights live, for `ep`'s explicit exchange: the mesh, the mesh axis the
    expert axis is split over (None: whole on every device), the specs of one layer's [E, D, F]
    (gate, up) and [E, F, D] (down) weights, and the mesh axes F is split over (their partial sums
    are added)."""

    mesh: Mesh
    axis: str | None
    in_spec: PartitionSpec  # [E, D, F]
    out_spec: PartitionSpec  # [E, F, D]
    mlp_axes: tuple[str, ...]

    @property
    def groups(self) -> int:  # Q
        return 1 if self.axis is None else self.mesh.shape[self.axis]


class Router(nnx.Module):
    """Softmax over all E experts in float32, then the top k; with `norm_topk_prob` the k weights are
    renormalized to sum to 1 (Qwen3-MoE's released models), else they stay the softmax's own.
    Under `numerics.router_fp32` the matmul takes float32 inputs and the weights stay float32. The
    router is never quantized (it is small, and its top-k decides which experts run)."""

    def __init__(self, dim: int, experts: int, top_k: int, norm_topk_prob: bool, *, numerics: Numerics = Numerics(),
                 dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.w = weight(rngs, (dim, experts), dim**-0.5, ("embed", "expert"), (0,), dtype, None)  # [D, E]
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.numerics = numerics

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [T, D] -> (weights [T, k] in x's dtype (float32 under router_fp32), chosen experts [T, k] i32, best first)."""
        fp32 = self.numerics.router_fp32
        x_in, w = (x.astype(jnp.float32), self.w[...].astype(jnp.float32)) if fp32 else (x, self.w[...])
        weights, chosen = route(x_in, w, self.top_k, self.norm_topk_prob, self.numerics)
        return (weights if fp32 else weights.astype(x.dtype)), chosen


def route(x: jax.Array, w: jax.Array, top_k: int, norm_topk_prob: bool, numerics: Numerics = Numerics(),
          replay: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x [T, D], router w [D, E] -> (weights [T, k] f32, chosen [T, k] i32); row-wise. `replay`
    [T, k] (a trainer's, from the served routed experts): these experts instead of the top k where
    >= 0 (-1: none given, the top k), their weights read from the same softmax (so equal to the top
    k's where they agree)."""

    def rows_route(rows: jax.Array, replayed: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        logits = jnp.einsum("TD,DE->TE", rows, w, preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)  # [T, E] f32
        weights, chosen = jax.lax.top_k(probs, top_k)  # ties go to the lower expert index, as torch.topk's do
        if replayed is not None:
            chosen = jnp.where(replayed >= 0, replayed, chosen)
            weights = jnp.take_along_axis(probs, chosen, axis=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(-1, keepdims=True)
        return weights, chosen

    return numerics.rowwise(rows_route, x, replay)


class Experts(nnx.Module):
    """E SwiGLU MLPs, stacked on a leading `expert` axis (the axis expert parallelism shards). Under
    int8 a weight's scales are per expert and output channel ([E, 1, F], [E, 1, D])."""

    def __init__(self, dim: int, hidden: int, experts: int, *, numerics: Numerics = Numerics(), dtype: jnp.dtype,
                 rngs: nnx.Rngs) -> None:
        self.numerics = numerics
        int8 = numerics.quantization
        self.gate = weight(rngs, (experts, dim, hidden), dim**-0.5, ("expert", "embed", "mlp"), (1,), dtype, int8)  # [E, D, F]
        self.up = weight(rngs, (experts, dim, hidden), dim**-0.5, ("expert", "embed", "mlp"), (1,), dtype, int8)  # [E, D, F]
        self.down = weight(rngs, (experts, hidden, dim), hidden**-0.5, ("expert", "mlp", "embed"), (1,), dtype, int8)  # [E, F, D]

    def fused(self, x: jax.Array, weights: jax.Array, chosen: jax.Array) -> jax.Array:
        """x [T, D], weights and chosen [T, k] -> [T, D]: every expert on every token."""
        return fused(x, weights, chosen, self.gate[...], self.up[...], self.down[...], self.numerics)

    def grouped(self, x: jax.Array, weights: jax.Array, chosen: jax.Array) -> jax.Array:
        """x [T, D], weights and chosen [T, k] -> [T, D]: each token through its k experts only."""
        return _grouped(x, weights, chosen, self.gate[...], self.up[...], self.down[...])

    def exchanged(self, x: jax.Array, weights: jax.Array, chosen: jax.Array, shards: ExpertShards) -> jax.Array:
        """`grouped` with the experts split over devices: the same [T, D], every device holding all of it."""
        gate, up, down = self.gate[...], self.up[...], self.down[...]
        specs = (PartitionSpec(),) * 3 + tuple(quantized.spec_of(w, spec) for w, spec in
                                               ((gate, shards.in_spec), (up, shards.in_spec), (down, shards.out_spec)))
        step = jax.shard_map(lambda *a: _exchange(*a, shards=shards), mesh=shards.mesh, in_specs=specs,
                             out_specs=PartitionSpec(), check_vma=False)
        return step(x, weights, chosen, gate, up, down)


Weight = jax.Array | QArray  # an expert stack, in the model dtype or int8 (quantized.py)


def fused(x: jax.Array, weights: jax.Array, chosen: jax.Array, gate: Weight, up: Weight, down: Weight,
          numerics: Numerics = Numerics()) -> jax.Array:
    """x [T, D], weights and chosen [T, k], expert weights [E, D, F], [E, D, F], [E, F, D] -> [T, D]
    (an int8 `down` is dequantized before its product, which sums over experts of their own scales)."""
    matmul = numerics.matmul
    # Each token's weight for every expert: its routing weight where chosen, 0 elsewhere (exact).
    combine = (weights[:, :, None] * jax.nn.one_hot(chosen, gate.shape[0], dtype=weights.dtype)).sum(1)  # [T, E]
    hidden = jax.nn.silu(matmul("TD,EDF->TEF", x, gate)) * matmul("TD,EDF->TEF", x, up) * combine[:, :, None]  # [T, E, F]
    return matmul("TEF,EFD->TD", hidden, down)  # rows of unchosen experts were 0


def _grouped(x: jax.Array, weights: jax.Array, chosen: jax.Array, gate: Weight, up: Weight, down: Weight) -> jax.Array:
    """x [T, D], weights and chosen [T, k], expert weights [E, D, F], [E, D, F], [E, F, D] -> [T, D].
    A chosen id >= E (the exchange's padding) is no expert: its row comes out 0."""
    num_tokens, top_k = chosen.shape
    num_experts = gate.shape[0]
    # Dispatch: the X = T*k assignments, flattened token-major, stably sorted by expert, so expert
    # e's rows are the group_sizes[e] contiguous rows after those of experts < e (ragged_dot's layout);
    # rows past the groups (ids >= E, sorted last, not counted) are left out of every matmul.
    expert_of = chosen.reshape(-1)  # [X]
    order = jnp.argsort(expert_of, stable=True)  # [X]: sorted row -> assignment
    rows = jnp.take(x, order // top_k, axis=0)  # [X, D]: assignment a belongs to token a // k
    group_sizes = jnp.bincount(expert_of, length=num_experts).astype(jnp.int32)  # [E]; ids >= E dropped
    row_expert = expert_of[order]  # [X]: an int8 weight's scales are per expert
    h = (jax.nn.silu(quantized.ragged_dot(rows, gate, group_sizes, row_expert))
         * quantized.ragged_dot(rows, up, group_sizes, row_expert))  # [X, F]
    out = quantized.ragged_dot(h, down, group_sizes, row_expert)  # [X, D]
    # Combine: the inverse permutation puts each row back at its (token, choice) assignment.
    out = jnp.take(out, jnp.argsort(order), axis=0).reshape(num_tokens, top_k, -1)  # [T, k, D]
    return jnp.einsum("TkD,Tk->TD", out, weights)


def _exchange(x: jax.Array, weights: jax.Array, chosen: jax.Array, gate: Weight, up: Weight, down: Weight,
              *, shards: ExpertShards) -> jax.Array:
    """One device's part of `Experts.exchanged` (inside shard_map): x, weights, chosen whole; its own
    E/Q experts, and 1/|mlp_axes| of their F. Returns [T, D], whole."""
    groups, axis = shards.groups, shards.axis
    if groups == 1:  # nothing to exchange; only F may be split
        return _sum_over(_grouped(x, weights, chosen, gate, up, down), shards.mlp_axes)
    num_tokens, top_k = chosen.shape
    local_experts = gate.shape[0]  # E / Q
    share = -(-num_tokens // groups)  # this device's tokens: rows [g * share, (g + 1) * share) of the padded step
    pad = groups * share - num_tokens
    x, weights, chosen = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x, weights, chosen))  # pad rows: expert 0, weight 0
    start = jax.lax.axis_index(axis) * share
    x, weights, chosen = (jax.lax.dynamic_slice_in_dim(a, start, share) for a in (x, weights, chosen))
    # Dispatch: this device's X = share * k assignments, sorted by expert (so by destination device),
    # laid out as Q blocks of X rows, block d holding the rows for device d first, then padding.
    expert_of = chosen.reshape(-1)  # [X]
    order = jnp.argsort(expert_of, stable=True)  # [X]: sorted row -> assignment
    dest = expert_of[order] // local_experts  # [X], ascending
    sent = jnp.bincount(dest, length=groups)  # [Q]: rows for each device
    slot = jnp.arange(dest.shape[0]) - (jnp.cumsum(sent) - sent)[dest]  # [X]: row within its block
    blocks = jnp.zeros((groups, dest.shape[0], x.shape[1]), x.dtype).at[dest, slot].set(jnp.take(x, order // top_k, axis=0))
    ids = jnp.full((groups, dest.shape[0]), local_experts, jnp.int32).at[dest, slot].set(expert_of[order] % local_experts)
    # [Q, X, D] and [Q, X]: block s now holds what device s sent here, padding marked by id E / Q.
    got, got_ids = (jax.lax.all_to_all(a, axis, 0, 0) for a in (blocks, ids))
    done = _grouped(got.reshape(-1, x.shape[1]), jnp.ones((got_ids.size, 1), x.dtype), got_ids.reshape(-1, 1), gate, up, down)
    back = jax.lax.all_to_all(done.reshape(blocks.shape), axis, 0, 0)  # [Q, X, D]: block d, our rows as device d ran them
    out = jnp.take(back[dest, slot], jnp.argsort(order), axis=0).reshape(share, top_k, -1)  # [share, k, D]
    mine = _sum_over(jnp.einsum("TkD,Tk->TD", out, weights), shards.mlp_axes)  # [share, D]
    return jax.lax.all_gather(mine, axis, tiled=True)[:num_tokens]  # [T, D]


def _sum_over(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    return jax.lax.psum(x, axes) if axes else x


class MoE(nnx.Module):
    """x [T, D] -> [T, D]. `strategy` is "fused" or "ep" (see the module docstring); `shards`, for
    `ep` on several devices, where the experts live."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, *, norm_topk_prob: bool, strategy: str,
                 numerics: Numerics = Numerics(), dtype: jnp.dtype, rngs: nnx.Rngs, shards: ExpertShards | None = None) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"MoE strategy must be one of {STRATEGIES}, got {strategy!r}")
        if numerics.batch_invariant and strategy != "fused":
            raise ValueError("MoE strategy must be 'fused' under batch_invariant: grouped matmuls' shapes follow the routing")
        self.router = Router(dim, experts, top_k, norm_topk_prob, numerics=numerics, dtype=dtype, rngs=rngs)
        self.experts = Experts(dim, hidden, experts, numerics=numerics, dtype=dtype, rngs=rngs)
        self.strategy = strategy
        self.shards = shards

    def __call__(self, x: jax.Array) -> jax.Array:
        weights, chosen = self.router(x)  # [T, k], [T, k]
        self.sow(Routed, "chosen", chosen)
        if self.strategy == "fused":
            out = self.experts.fused(x, weights, chosen)
        elif self.shards is None:
            out = self.experts.grouped(x, weights, chosen)
        else:
            out = self.experts.exchanged(x, weights, chosen, self.shards)
        return out.astype(x.dtype)  # float32 routing weights (router_fp32) weighted the sum in float32
