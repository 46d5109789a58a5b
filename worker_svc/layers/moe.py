"""Mixture of experts (Shazeer et al., 2017), as Qwen3-MoE, Mixtral and GPT-OSS use it: a router scores
every expert for each token, the top k are kept, and the token's output is the routing-weighted sum of
those experts' SwiGLU MLPs.

GPT-OSS's differs in three ways, each a switch here: its router has a bias and takes the top k of its
logits, then a softmax over those k alone (`softmax_over_chosen`); its experts hold gate and up side
by side in one matrix, with a bias after each projection (`GateUpExperts`); and their SwiGLU is
clamped (`ClampedSwiGLU`).

Two strategies compute the same sum, chosen by the config's `moe.strategy`:

- `fused`: every token through every expert densely, combined with weights that are zero off the
  token's top k. E / k times the needed FLOPs, but only plain einsums: simple, for few experts.
- `ep`: the (token, choice) assignments sorted by expert, so each expert's rows are contiguous, and run
  through grouped matmuls (`jax.lax.ragged_dot`; on a TPU, JAX's megablox kernel through
  Numerics.ragged_dot), then unsorted and combined. Only the chosen experts'
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
from typing import Any, Callable

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
    renormalized to sum to 1 (Qwen3-MoE's released models), else they stay the softmax's own. With
    `softmax_over_chosen` (GPT-OSS): the top k of the logits, then a softmax over those k alone.
    `bias` (GPT-OSS): a bias [E] added to the logits. Under `numerics.router_fp32` the matmul takes
    float32 inputs and the weights stay float32. The router is never quantized (it is small, and its
    top-k decides which experts run)."""

    def __init__(self, dim: int, experts: int, top_k: int, norm_topk_prob: bool, *, bias: bool = False,
                 softmax_over_chosen: bool = False, numerics: Numerics = Numerics(), dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.w = weight(rngs, (dim, experts), dim**-0.5, ("embed", "expert"), (0,), dtype, None)  # [D, E]
        # A random stand-in as the weight's (loading.py fills it).
        self.bias = _param(rngs, (experts,), ("expert",), dtype) if bias else None  # [E]
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.softmax_over_chosen = softmax_over_chosen
        self.numerics = numerics

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [T, D] -> (weights [T, k] in x's dtype (float32 under router_fp32), chosen experts [T, k] i32, best first)."""
        bias = None if self.bias is None else self.bias[...]
        return in_router_numerics(x, self.w[...], self.numerics, lambda x, w: route(
            x, w, self.top_k, self.norm_topk_prob, self.numerics, bias=bias, softmax_over_chosen=self.softmax_over_chosen))


def in_router_numerics(x: jax.Array, w: jax.Array, numerics: Numerics,
                       routing: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]) -> tuple[jax.Array, jax.Array]:
    """routing(x [T, D], router w [D, E]) -> (weights [T, k] f32, chosen [T, k]), run as every router here
    runs: under router_fp32 from float32 inputs and weights, its weights kept float32 into the experts'
    sum; else from x's dtype, its weights cast to it."""
    fp32 = numerics.router_fp32
    x_in, w = (x.astype(jnp.float32), w.astype(jnp.float32)) if fp32 else (x, w)
    weights, chosen = routing(x_in, w)
    return (weights if fp32 else weights.astype(x.dtype)), chosen


def route(x: jax.Array, w: jax.Array, top_k: int, norm_topk_prob: bool, numerics: Numerics = Numerics(),
          replay: jax.Array | None = None, *, bias: jax.Array | None = None,
          softmax_over_chosen: bool = False) -> tuple[jax.Array, jax.Array]:
    """x [T, D], router w [D, E] (and its `bias` [E]) -> (weights [T, k] f32, chosen [T, k] i32);
    row-wise. `replay` [T, k] (a trainer's, from the served routed experts): these experts instead of
    the top k where >= 0 (-1: none given, the top k), their weights read from the same softmax (so
    equal to the top k's where they agree)."""

    def rows_route(rows: jax.Array, replayed: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        logits = jnp.einsum("TD,DE->TE", rows, w, preferred_element_type=jnp.float32)
        if bias is not None:
            logits = logits + bias.astype(jnp.float32)
        if softmax_over_chosen:  # the k largest logits, then the softmax over them alone
            chosen = jax.lax.top_k(logits, top_k)[1]  # ties go to the lower expert index, as torch.topk's do
            if replayed is not None:
                chosen = jnp.where(replayed >= 0, replayed, chosen)
            return jax.nn.softmax(jnp.take_along_axis(logits, chosen, axis=-1), axis=-1), chosen
        probs = jax.nn.softmax(logits, axis=-1)  # [T, E] f32
        weights, chosen = jax.lax.top_k(probs, top_k)  # ties go to the lower expert index, as torch.topk's do
        if replayed is not None:
            chosen = jnp.where(replayed >= 0, replayed, chosen)
            weights = jnp.take_along_axis(probs, chosen, axis=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(-1, keepdims=True)
        return weights, chosen

    return numerics.rowwise(rows_route, x, replay)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str | None, ...], dtype: jnp.dtype) -> nnx.Param:
    """A bias: never quantized (it is not a matmul's weight)."""
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype), out_sharding=names, eager_sharding=False)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's expert activation (transformers' GptOssExperts._apply_gate): the gate clamped above
    at `limit`, the up projection to +-limit, then gate * sigmoid(alpha * gate) * (up + 1)."""

    alpha: float
    limit: float

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


Stack = Any  # one layer's expert weights as the strategies pass them: a tuple of arrays (or QArrays), each led by [E]
RowsMlp = Callable[[Stack, jax.Array, jax.Array, jax.Array], jax.Array]  # (stack, rows, group sizes, row expert) -> rows out


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
        return _grouped(x, weights, chosen, (self.gate[...], self.up[...], self.down[...]), self._rows)

    def exchanged(self, x: jax.Array, weights: jax.Array, chosen: jax.Array, shards: ExpertShards) -> jax.Array:
        """`grouped` with the experts split over devices: the same [T, D], every device holding all of it."""
        stack = (self.gate[...], self.up[...], self.down[...])
        return _exchanged(x, weights, chosen, stack, (shards.in_spec, shards.in_spec, shards.out_spec), self._rows, shards)

    def _rows(self, stack: Stack, rows: jax.Array, group_sizes: jax.Array, row_expert: jax.Array) -> jax.Array:
        return _swiglu_rows(stack, rows, group_sizes, row_expert, self.numerics)


class GateUpExperts(nnx.Module):
    """GPT-OSS's experts: E MLPs whose gate and up projections are one matrix, each followed by a bias,
    with `activation` (ClampedSwiGLU) between them and the down projection. `gate_up` [E, D, 2, F]
    holds each expert's gate ([:, :, 0]) and up ([:, :, 1]) side by side, so splitting F (`mlp`) over
    devices splits both alike; its int8 scales are per expert and output channel ([E, 1, 2, F]).
    The down projection's bias is added by `MoE`, weighted by the routing, outside any split of F."""

    def __init__(self, dim: int, hidden: int, experts: int, activation: ClampedSwiGLU, *, numerics: Numerics = Numerics(),
                 dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.numerics = numerics
        self.activation = activation
        int8 = numerics.quantization
        self.gate_up = weight(rngs, (experts, dim, 2, hidden), dim**-0.5, ("expert", "embed", None, "mlp"), (1,), dtype,
                              int8)  # [E, D, 2, F]
        self.gate_up_bias = _param(rngs, (experts, 2, hidden), ("expert", None, "mlp"), dtype)  # [E, 2, F]
        self.down = weight(rngs, (experts, hidden, dim), hidden**-0.5, ("expert", "mlp", "embed"), (1,), dtype, int8)  # [E, F, D]
        self.down_bias = _param(rngs, (experts, dim), ("expert", "embed"), dtype)  # [E, D]

    def fused(self, x: jax.Array, weights: jax.Array, chosen: jax.Array) -> jax.Array:
        """x [T, D], weights and chosen [T, k] -> [T, D] (without the down bias): every expert on every token."""
        matmul = self.numerics.matmul
        combine = _combine(weights, chosen, self.gate_up_bias.shape[0])  # [T, E]
        gate_up = matmul("TD,EDGF->TEGF", x, self.gate_up[...]) + self.gate_up_bias[...]  # [T, E, 2, F]
        hidden = self.activation(gate_up[:, :, 0], gate_up[:, :, 1]) * combine[:, :, None]  # [T, E, F]
        return matmul("TEF,EFD->TD", hidden, self.down[...])  # rows of unchosen experts were 0

    def grouped(self, x: jax.Array, weights: jax.Array, chosen: jax.Array) -> jax.Array:
        return _grouped(x, weights, chosen, self._stack(), self._rows)

    def exchanged(self, x: jax.Array, weights: jax.Array, chosen: jax.Array, shards: ExpertShards) -> jax.Array:
        in_spec, out_spec = shards.in_spec, shards.out_spec  # of [E, D, F] and [E, F, D]
        specs = (PartitionSpec(*in_spec[:2], None, *in_spec[2:]), PartitionSpec(in_spec[0], None, *in_spec[2:]), out_spec)
        return _exchanged(x, weights, chosen, self._stack(), specs, self._rows, shards)

    def _stack(self) -> Stack:
        return self.gate_up[...], self.gate_up_bias[...], self.down[...]

    def _rows(self, stack: Stack, rows: jax.Array, group_sizes: jax.Array, row_expert: jax.Array) -> jax.Array:
        """Sorted rows [X, D] through their experts -> [X, D] (without the down bias): [E, D, 2, F] read
        as [E, D, 2F] (a reshape that moves nothing) for one grouped matmul."""
        gate_up, bias, down = stack
        merged = _merge_last(gate_up)
        ragged_dot = self.numerics.ragged_dot
        out = ragged_dot(rows, merged, group_sizes, row_expert).reshape(rows.shape[0], 2, -1)  # [X, 2, F]
        out = out + jnp.take(bias, row_expert, axis=0, mode="fill", fill_value=0)  # a row of no expert: 0, as its product
        return ragged_dot(self.activation(out[:, 0], out[:, 1]), down, group_sizes, row_expert)

    def down_bias_sum(self, weights: jax.Array, chosen: jax.Array) -> jax.Array:
        """The routing-weighted sum of the chosen experts' down biases, [T, D] (row-wise, numerics.rowwise)."""
        bias = self.down_bias[...]
        return self.numerics.rowwise(
            lambda w, c: jnp.einsum("Tk,TkD->TD", w, jnp.take(bias, c, axis=0).astype(w.dtype)), weights, chosen)


def _merge_last(w: jax.Array | QArray) -> jax.Array | QArray:
    """[E, A, 2, F] -> [E, A, 2F] (an int8 weight's scale [E, 1, 2, F] alike)."""
    if isinstance(w, QArray):
        return QArray(_merge_last(w.values), _merge_last(w.scale))
    return w.reshape(*w.shape[:2], -1)


Weight = jax.Array | QArray  # an expert stack, in the model dtype or int8 (quantized.py)


def fused(x: jax.Array, weights: jax.Array, chosen: jax.Array, gate: Weight, up: Weight, down: Weight,
          numerics: Numerics = Numerics()) -> jax.Array:
    """x [T, D], weights and chosen [T, k], expert weights [E, D, F], [E, D, F], [E, F, D] -> [T, D]
    (an int8 `down` is dequantized before its product, which sums over experts of their own scales)."""
    matmul = numerics.matmul
    combine = _combine(weights, chosen, gate.shape[0])  # [T, E]
    hidden = jax.nn.silu(matmul("TD,EDF->TEF", x, gate)) * matmul("TD,EDF->TEF", x, up) * combine[:, :, None]  # [T, E, F]
    return matmul("TEF,EFD->TD", hidden, down)  # rows of unchosen experts were 0


def _combine(weights: jax.Array, chosen: jax.Array, num_experts: int) -> jax.Array:
    """Each token's weight for every expert [T, E]: its routing weight where chosen, 0 elsewhere (exact)."""
    return (weights[:, :, None] * jax.nn.one_hot(chosen, num_experts, dtype=weights.dtype)).sum(1)


def _swiglu_rows(stack: Stack, rows: jax.Array, group_sizes: jax.Array, row_expert: jax.Array, numerics: Numerics) -> jax.Array:
    """Sorted rows [X, D] through their experts' SwiGLU (gate, up [E, D, F], down [E, F, D]) -> [X, D],
    each grouped matmul by `numerics.ragged_dot` (a platform's kernel where it has one)."""
    gate, up, down = stack
    ragged_dot = numerics.ragged_dot
    h = jax.nn.silu(ragged_dot(rows, gate, group_sizes, row_expert)) * ragged_dot(rows, up, group_sizes, row_expert)  # [X, F]
    return ragged_dot(h, down, group_sizes, row_expert)  # [X, D]


def _grouped(x: jax.Array, weights: jax.Array, chosen: jax.Array, stack: Stack, mlp: RowsMlp) -> jax.Array:
    """x [T, D], weights and chosen [T, k], one layer's expert weights (led by [E]) and how rows go
    through them -> [T, D]. A chosen id >= E (the exchange's padding) is no expert: its row comes out 0."""
    num_tokens, top_k = chosen.shape
    num_experts = stack[0].shape[0]
    # Dispatch: the X = T*k assignments, flattened token-major, stably sorted by expert, so expert
    # e's rows are the group_sizes[e] contiguous rows after those of experts < e (ragged_dot's layout);
    # rows past the groups (ids >= E, sorted last, not counted) are left out of every matmul.
    expert_of = chosen.reshape(-1)  # [X]
    order = jnp.argsort(expert_of, stable=True)  # [X]: sorted row -> assignment
    rows = jnp.take(x, order // top_k, axis=0)  # [X, D]: assignment a belongs to token a // k
    group_sizes = jnp.bincount(expert_of, length=num_experts).astype(jnp.int32)  # [E]; ids >= E dropped
    row_expert = expert_of[order]  # [X]: an int8 weight's scales are per expert
    out = mlp(stack, rows, group_sizes, row_expert)  # [X, D]
    # Combine: the inverse permutation puts each row back at its (token, choice) assignment.
    out = jnp.take(out, jnp.argsort(order), axis=0).reshape(num_tokens, top_k, -1)  # [T, k, D]
    return jnp.einsum("TkD,Tk->TD", out, weights)


def _exchanged(x: jax.Array, weights: jax.Array, chosen: jax.Array, stack: Stack, specs: tuple, mlp: RowsMlp,
               shards: ExpertShards) -> jax.Array:
    """`_exchange` on every device: `specs`, the PartitionSpec of each of the stack's weights."""
    specs = (PartitionSpec(),) * 3 + tuple(quantized.spec_of(w, spec) for w, spec in zip(stack, specs))
    step = jax.shard_map(lambda x, weights, chosen, *stack: _exchange(x, weights, chosen, stack, mlp=mlp, shards=shards),
                         mesh=shards.mesh, in_specs=specs, out_specs=PartitionSpec(), check_vma=False)
    return step(x, weights, chosen, *stack)


def _exchange(x: jax.Array, weights: jax.Array, chosen: jax.Array, stack: Stack, *, mlp: RowsMlp,
              shards: ExpertShards) -> jax.Array:
    """One device's part of `Experts.exchanged` (inside shard_map): x, weights, chosen whole; its own
    E/Q experts, and 1/|mlp_axes| of their F. Returns [T, D], whole."""
    groups, axis = shards.groups, shards.axis
    if groups == 1:  # nothing to exchange; only F may be split
        return _sum_over(_grouped(x, weights, chosen, stack, mlp), shards.mlp_axes)
    num_tokens, top_k = chosen.shape
    local_experts = stack[0].shape[0]  # E / Q
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
    done = _grouped(got.reshape(-1, x.shape[1]), jnp.ones((got_ids.size, 1), x.dtype), got_ids.reshape(-1, 1), stack, mlp)
    back = jax.lax.all_to_all(done.reshape(blocks.shape), axis, 0, 0)  # [Q, X, D]: block d, our rows as device d ran them
    out = jnp.take(back[dest, slot], jnp.argsort(order), axis=0).reshape(share, top_k, -1)  # [share, k, D]
    mine = _sum_over(jnp.einsum("TkD,Tk->TD", out, weights), shards.mlp_axes)  # [share, D]
    return jax.lax.all_gather(mine, axis, tiled=True)[:num_tokens]  # [T, D]


def _sum_over(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    return jax.lax.psum(x, axes) if axes else x


def check_strategy(strategy: str, numerics: Numerics) -> None:
    """A ValueError unless `strategy` is one of STRATEGIES, and `fused` under batch_invariant."""
    if strategy not in STRATEGIES:
        raise ValueError(f"MoE strategy must be one of {STRATEGIES}, got {strategy!r}")
    if numerics.batch_invariant and strategy != "fused":
        raise ValueError("MoE strategy must be 'fused' under batch_invariant: grouped matmuls' shapes follow the routing")


def through_experts(experts: Experts | GateUpExperts, x: jax.Array, weights: jax.Array, chosen: jax.Array, strategy: str,
                    shards: ExpertShards | None) -> jax.Array:
    """x [T, D] through each token's chosen experts [T, k], weighted [T, k] -> [T, D], by `strategy`:
    every expert on every token (`fused`), or each token's k only (`ep`), exchanged between the
    experts' devices where `shards` splits them."""
    if strategy == "fused":
        return experts.fused(x, weights, chosen)
    if shards is None:
        return experts.grouped(x, weights, chosen)
    return experts.exchanged(x, weights, chosen, shards)


class MoE(nnx.Module):
    """x [T, D] -> [T, D]. `strategy` is "fused" or "ep" (see the module docstring); `shards`, for
    `ep` on several devices, where the experts live. `clamped` given (GPT-OSS): the router has a bias
    and a softmax over the chosen k alone, and the experts are `GateUpExperts` with that activation."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, *, norm_topk_prob: bool, strategy: str,
                 numerics: Numerics = Numerics(), dtype: jnp.dtype, rngs: nnx.Rngs, shards: ExpertShards | None = None,
                 clamped: ClampedSwiGLU | None = None) -> None:
        check_strategy(strategy, numerics)
        gpt_oss = clamped is not None
        self.router = Router(dim, experts, top_k, norm_topk_prob, bias=gpt_oss, softmax_over_chosen=gpt_oss, numerics=numerics,
                             dtype=dtype, rngs=rngs)
        self.experts = (GateUpExperts(dim, hidden, experts, clamped, numerics=numerics, dtype=dtype, rngs=rngs) if gpt_oss
                        else Experts(dim, hidden, experts, numerics=numerics, dtype=dtype, rngs=rngs))
        self.strategy = strategy
        self.shards = shards

    def __call__(self, x: jax.Array) -> jax.Array:
        weights, chosen = self.router(x)  # [T, k], [T, k]
        self.sow(Routed, "chosen", chosen)
        out = through_experts(self.experts, x, weights, chosen, self.strategy, self.shards)
        if isinstance(self.experts, GateUpExperts):
            out = out + self.experts.down_bias_sum(weights, chosen)
        return out.astype(x.dtype)  # float32 routing weights (router_fp32) weighted the sum in float32
