"""A layer of a stacked weight, handed to the layer body whole with the layer's row, so a kernel of
our own reads the layer where it lies in the stack (`StackLayer`).

Why. The decoder runs its stacked layers with `jax.lax.scan`. A scan slices each stacked weight
[L, ...] at its layer with a dynamic-slice, and XLA:CPU writes that slice out as a copy before the
matmul reads it: a layer's weights cross memory twice. In a step of few rows, where the model's
kernels take the products (Numerics.reads_stacked_whole; on CPU, worker_svc/cpu_kernels/), the
layer scan leaves the layers' matmul weights unscanned, and the layer body gets each as a
`StackLayer` (the stacked array and the traced row): `Numerics.matmul` hands the kernel the stack
and the row, and the kernel reads that layer in place. Where the kernel does not take a product,
`Numerics.matmul` slices the layer out, as the scan would have. Nothing else changes: loading,
sharding and the hot swap see the same stacked leaves.

Which weights: those a layer module lists in its IN_PLACE attribute names (Attention's q, k, v, o;
SwiGLU's gate, up, down): the dense matmul weights, almost all of a dense model's bytes. Norm scales
are small, and MoE experts are read by ragged_dot or a sharded exchange (moe.py): they stay scanned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx


@jax.tree_util.register_pytree_node_class
class StackLayer:
    """In the layer body: layer `row` (traced) of a stacked weight [L, ...] handed whole, unscanned, for
    the model's kernels to read the layer where it lies in the stack (Numerics.matmul; else it slices)."""

    def __init__(self, stack: Any, row: Any) -> None:
        self.stack, self.row = stack, row

    def tree_flatten(self) -> tuple[tuple[Any, Any], None]:
        return (self.stack, self.row), None

    @classmethod
    def tree_unflatten(cls, _: None, leaves: Sequence[Any]) -> "StackLayer":
        return cls(*leaves)

    def __getitem__(self, index: Any) -> "StackLayer":  # a Variable's `var[...]`
        return self

    def sliced(self) -> Any:
        """The layer's weight, sliced out of the stack (as the layer scan slices a scanned weight)."""
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, self.row, keepdims=False), self.stack)


def in_place_paths(stack: nnx.Module) -> tuple[tuple, ...]:
    """The paths, within a stacked layer module, of the weights its modules read in place (IN_PLACE)."""
    return tuple((*path, name) for path, node in nnx.iter_graph(stack)
                 if isinstance(node, nnx.Module) for name in getattr(type(node), "IN_PLACE", ()))
