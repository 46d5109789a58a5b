"""How the model does its arithmetic, beyond what its weights say: the serving switches an RL
trainer aligns its own numbers with (config worker.batch_invariant, router_fp32, lm_head_fp32;
docs/design.md, "RL numerics"). Every layer holds the model's one `Numerics` and runs its weight
matmuls through `matmul`.

Why a token's numbers move with its batch (measured on XLA:CPU, float32): a matmul's kernel, and
so the order it sums a row's products in, is chosen by the matrix's shape. One row of [M, D] @
[D, F] comes out the same wherever it sits among M rows and whatever the other rows hold, but not
for another M: M = 1, 2..32 and 64.. gave three different results for the same row. RMSNorm's row
sums over [T, D] changed too, from T = 64 on. A step's token count follows its batch, so did these.
Under `batch_invariant`, `matmul` runs every matmul, and `rowwise` every computation that sums
along a row (norms, the router, sampling, prompt logprobs), over tiles of ROW_TILE rows: one
compiled shape for every tile, so a row's result is a function of that row alone, whatever the
step, and whatever program (the trainer's) runs the same layers. Attention gets a fixed order of
its own (ordered_attention.py), and MoE layers the dense `fused` strategy, whose
shapes do not follow the routing.

`quantization` (worker.quantization) is how the weight matmuls' weights are held: null, in the model
dtype; "int8", int8 values with a scale per output channel (quantized.py), converted to the
activations' dtype inside `matmul` (under batch_invariant, dequantized once before the tiles).
`kernels`: a platform's kernels of our own (kernels.py's `Kernels`; on XLA:CPU, worker_svc/cpu_kernels/,
which start-up builds and injects), or None. A product of a few float32 rows by a float32 or int8
weight runs in its kernel where it takes it, and in such a step the layer scan hands each stacked
weight whole with its layer row (stack_layer.StackLayer), which the kernel reads in place;
attention asks it for the state over the cache and over the step's own keys (attention.py). Never
under batch_invariant.

Shapes in the legend of worker_svc/__init__.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

from worker_svc.layers import quantized
from worker_svc.layers.kernels import Kernels
from worker_svc.layers.stack_layer import StackLayer

ROW_TILE = 32  # rows per tile under batch_invariant: a decode step of up to 32 rows is one tile


@dataclass(frozen=True)
class Numerics:
    batch_invariant: bool = False  # matmuls in fixed row tiles, attention and MoE in fixed orders
    router_fp32: bool = False  # MoE router matmul, softmax, top-k and routing weights in float32
    lm_head_fp32: bool = False  # the final norm's output and the LM head in float32
    quantization: str | None = None  # None, or "int8": weight matmuls' weights as int8 and scales (quantized.py)
    kernels: Kernels | None = None  # a platform's kernels of our own (kernels.py), injected at start-up; None: jax.numpy's way

    def matmul(self, spec: str, x: jax.Array, w: jax.Array | quantized.QArray, **kwargs) -> jax.Array:
        """jnp.einsum(spec, x, w, **kwargs) with x's leading axis its rows (tokens: T or R), which
        the output leads with too; under batch_invariant, computed ROW_TILE rows at a time. An int8
        `w` (a QArray) is converted to x's dtype and scaled (quantized.einsum); under batch_invariant,
        dequantized once before the tiles, which then multiply by one float array, as for float
        weights (converted within each tile, a step of one tile and one of several were compiled
        into different products: measured 5e-7 apart in logprobs)."""
        if isinstance(w, quantized.QArray) and isinstance(w.values, StackLayer):  # int8, a layer of a stack
            w = StackLayer(quantized.QArray(w.values.stack, w.scale.stack), w.values.row)
        merged_spec, merged_x, contracted = _merged(spec, x)
        if isinstance(w, StackLayer):  # a layer of a stack handed whole: the kernel reads it in place, else a slice
            stack, row = w.stack, w.row
            if contracted > 1 and _mergeable(stack, contracted, lead=1):
                spec, x, stack, contracted = merged_spec, merged_x, _merged_weight(stack, contracted, lead=1), 1
            y = self._by_kernel(spec, x, stack, row, **kwargs)
            if y is not None:
                return y
            w = StackLayer(stack, row).sliced()
        if contracted > 1 and _mergeable(w, contracted):
            spec, x, w = merged_spec, merged_x, _merged_weight(w, contracted)
        y = self._by_kernel(spec, x, w, **kwargs)  # the kernel contracts one axis
        if y is not None:
            return y
        if self.batch_invariant and isinstance(w, quantized.QArray):
            w = jax.lax.optimization_barrier(quantized.dequantize(w, x.dtype))
        return self.rowwise(lambda rows: quantized.einsum(spec, rows, w, **kwargs), x)

    def _by_kernel(self, spec: str, x: jax.Array, w: jax.Array | quantized.QArray, row: jax.Array | None = None,
                   **kwargs) -> jax.Array | None:
        """The product by the kernels (with `row`: w a stack, the product with its layer `row`), or
        None where there are none, under batch_invariant, or where they do not take it."""
        if self.kernels is None or self.batch_invariant:
            return None
        return self.kernels.product(spec, x, w, row, **kwargs)

    def reads_stacked_whole(self, rows: int) -> bool:
        """Whether a step of `rows` rows hands the layer scan's matmul weights whole, each a
        StackLayer, for the kernel to read its layer in place (decoder.py), not scanned."""
        return self.kernels is not None and not self.batch_invariant and self.kernels.reads_stacked_whole(rows)

    def kernel_attends(self, q_dtype: Any, cache_dtype: Any, group: int, head_dim: int) -> bool:
        """Whether the kernels read a cache of `cache_dtype` for queries of `q_dtype`, `group` query
        heads per key head and head dimension `head_dim` (the engine then reads every step's cache
        through page lists: batch.py's `Buckets.choose_page_lists`). Never under batch_invariant."""
        return self.kernels is not None and not self.batch_invariant and self.kernels.attends(q_dtype, cache_dtype, group,
                                                                                                head_dim)

    def ragged_dot(self, rows: jax.Array, w: jax.Array | quantized.QArray, group_sizes: jax.Array,
                   row_group: jax.Array) -> jax.Array:
        """MoE's grouped matmul: quantized.ragged_dot (rows [X, A] by w [E, A, B], groups of rows by
        expert), by the kernels where they take it (never under batch_invariant, whose MoE is fused)."""
        if self.kernels is not None and not self.batch_invariant:
            y = self.kernels.grouped_product(rows, w, group_sizes, row_group)
            if y is not None:
                return y
        return quantized.ragged_dot(rows, w, group_sizes, row_group)

    def rowwise(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) for an fn whose every output row is computed from the same row of each input
        alone (a norm, a softmax, sampling): every leaf of args and of the result leads with the
        rows. Under batch_invariant, run ROW_TILE rows at a time."""
        return by_tiles(fn, *args) if self.batch_invariant else fn(*args)


def _merged(spec: str, x: jax.Array) -> tuple[str, jax.Array, int]:
    """A matmul contracting several axes, x's last ones and the weight's first ones in the same order
    (o's "TNH,NHD->TD"), as one contracting a single merged axis: (its spec, x reshaped, how many
    weight axes `_merged_weight` merges). Else (spec, x, 1). XLA:CPU would otherwise transpose the
    weight into its own order of the contracted axes: a copy of o's weight per layer and step, for a
    stacked weight beside its slice's copy (measured in docs/performance.md). The int8 kernel
    contracts one axis."""
    inputs, out = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    contracted = "".join(a for a in x_axes if a in w_axes and a not in out)
    n = len(contracted)
    if n < 2 or not x_axes.endswith(contracted) or not w_axes.startswith(contracted):
        return spec, x, 1
    merged = next(a for a in "XYZWQJ" if a not in spec)
    return f"{x_axes[:-n]}{merged},{merged}{w_axes[n:]}->{out}", x.reshape(*x.shape[:-n], -1), n


def _mergeable(w: jax.Array | quantized.QArray, n: int, lead: int = 0) -> bool:
    """Whether `_merged_weight` may merge w's n axes after its `lead` ones (a stack's layer axis): a
    float weight's always; an int8 one's where its scale is 1 along them (not experts with scales of
    their own)."""
    return not isinstance(w, quantized.QArray) or all(s == 1 for s in w.scale.shape[lead:lead + n])


def _merged_weight(w: jax.Array | quantized.QArray, n: int, lead: int = 0) -> jax.Array | quantized.QArray:
    """w with its n axes after the `lead` ones as one (a reshape that moves nothing); an int8 w's
    scale is 1 along them."""
    if n == 1:
        return w

    def merge(a: jax.Array, size: int) -> jax.Array:
        return a.reshape(*a.shape[:lead], size, *a.shape[lead + n:])

    if isinstance(w, quantized.QArray):
        return quantized.QArray(merge(w.values, -1), merge(w.scale, 1))
    return merge(w, -1)


def by_tiles(fn: Callable[..., Any], *args: Any) -> Any:
    """fn over the rows of args in tiles of ROW_TILE (the last padded with zero rows): a sequential
    loop of one compiled shape, so each row's sums run in an order its batch cannot change."""
    rows = jax.tree.leaves(args)[0].shape[0]
    tiles = -(-rows // ROW_TILE)

    def split(a: jax.Array) -> jax.Array:
        a = jnp.pad(a, [(0, tiles * ROW_TILE - rows)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(tiles, ROW_TILE, *a.shape[1:])

    # The barrier keeps the padding rows in: XLA may otherwise move a pad across a dot (computing
    # the unpadded shape, whose kernel sums in another order), as it did on GPU.
    out = jax.lax.map(lambda tile: fn(*tile), jax.lax.optimization_barrier(jax.tree.map(split, args)))
    return jax.tree.map(lambda a: a.reshape(tiles * ROW_TILE, *a.shape[2:])[:rows], out)
