"""Layer weights read in place (issue 21, item 2), two ways: each layer's matmul weights held as a
buffer of their own, and a step's layer body reaching its layer's buffers through `jax.lax.switch`
(worker.weights_in_place, off by default); or, in a step of few rows on CPU, the stacked weights
handed to the layer body whole with the layer's row (`StackLayer`), for product_kernel.py's kernel
to read the layer where it lies (worker.product_kernel, on by default).

Why. The decoder runs its stacked layers with `jax.lax.scan`. A scan slices each stacked weight
[L, ...] at its layer with a dynamic-slice, and XLA:CPU writes that slice out as a copy before the
matmul reads it: a layer's weights cross memory twice. The layers unrolled over buffers of their own
read in place, but compile 5x slower and run slower (benchmarks/DEVELOPERS.md). Here the layer
body stays one compiled body in a loop; only its weight matmuls branch, `lax.switch(layer, [the
matmul on layer 0's buffer, ..., layer L-1's])`, and each branch reads its own buffer where it lies.
A branch is one matmul, and the layer body is still compiled once; but the branches add up:
start-up compile took 45% longer for SmolLM2 on XLA:CPU, for the same step speed there
(benchmarks/layer_stack.py, benchmarks/DEVELOPERS.md), which is why the switch is off by default.

The parameter tree: a held weight's Variable (its `values` and `scale` under int8) holds a `Layers`
in place of its stacked array: the L buffers, still telling the stacked shape and dtype, and still
read as the stacked array on the host (np.asarray: the hot swap's host copies, hf_index's reads).
Loading and sharding see stacked arrays; with worker.weights_in_place the engine holds the weights
per layer after placing them (`hold`). In the layer scan the held leaves are not
scanned: the layer body gets a `OneLayer` (the buffers and the traced layer row), and
`Numerics.matmul` runs `switch`.

The product kernel's way needs no second tree: the layer scan leaves the same weights unscanned,
and the layer body gets a `StackLayer` (the stacked array and the traced row). Where the kernel does
not take a product, `Numerics.matmul` slices the layer out, as the scan would have.

Which weights: those a layer module lists in its IN_PLACE attribute names (Attention's q, k, v, o;
SwiGLU's gate, up, down): the dense matmul weights, almost all of a dense model's bytes. Norm scales
are small, and MoE experts are read by ragged_dot or a sharded exchange (moe.py): they stay scanned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec


@jax.tree_util.register_pytree_node_class
class Layers:
    """A stacked weight [L, ...] held as L buffers, one per layer."""

    def __init__(self, parts: Sequence[Any]) -> None:
        self.parts = tuple(parts)

    def tree_flatten(self) -> tuple[tuple[Any, ...], None]:
        return self.parts, None

    @classmethod
    def tree_unflatten(cls, _: None, parts: Iterable[Any]) -> "Layers":
        return cls(tuple(parts))

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *self.parts[0].shape)

    @property
    def dtype(self) -> Any:
        return self.parts[0].dtype

    def __getitem__(self, index: Any) -> Any:
        """[...] (a Variable's read): itself; [i]: layer i's buffer; any other index: of the stacked
        array on the host."""
        if index is Ellipsis:
            return self
        if isinstance(index, (int, np.integer)):
            return self.parts[index]
        return np.asarray(self)[index]

    def __eq__(self, other: object) -> bool:
        """Layer by layer, as trees of leaves compare: the same buffers (arrays are compared by
        identity, never elementwise), or equal values of another kind (a tree of shapes)."""
        return isinstance(other, Layers) and len(self.parts) == len(other.parts) and all(
            a is b if isinstance(a, jax.Array) else a == b for a, b in zip(self.parts, other.parts))

    __hash__ = None  # type: ignore[assignment]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """The stacked array on the host."""
        return np.stack([np.asarray(part) for part in self.parts]).astype(dtype or self.dtype, copy=False)


@jax.tree_util.register_pytree_node_class
class OneLayer:
    """In the layer body: layer row `index` (traced) of `parts`, the layer buffers of a `Layers`."""

    def __init__(self, parts: Sequence[Any], index: Any) -> None:
        self.parts, self.index = tuple(parts), index

    def tree_flatten(self) -> tuple[tuple[Any, ...], None]:
        return (*self.parts, self.index), None

    @classmethod
    def tree_unflatten(cls, _: None, leaves: Sequence[Any]) -> "OneLayer":
        *parts, index = leaves
        return cls(parts, index)

    def __getitem__(self, index: Any) -> "OneLayer":  # a Variable's `var[...]`
        return self

    def apply(self, fn: Callable[[Any], Any]) -> Any:
        """fn(this layer's weight), reading the weight where it lies: one switch branch per layer."""
        return jax.lax.switch(self.index, [lambda part=part: fn(part) for part in self.parts])


@jax.tree_util.register_pytree_node_class
class StackLayer:
    """In the layer body: layer `row` (traced) of a stacked weight [L, ...] handed whole, unscanned, for
    product_kernel.py to read the layer where it lies in the stack (Numerics.matmul; else it slices)."""

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


def layer_sharding(stacked: Any) -> Any:
    """The sharding of one layer of a stacked array sharded as `stacked`: its spec without the leading
    (layer) axis, which no rule splits."""
    if isinstance(stacked, NamedSharding):
        spec = tuple(stacked.spec)
        if spec and spec[0] is not None:
            raise ValueError(f"a weight held per layer has its layer axis sharded ({stacked.spec})")
        return NamedSharding(stacked.mesh, PartitionSpec(*spec[1:]))
    return stacked


def split(value: Any, sharding: Any) -> Layers:
    """A stacked host (or device) array as a `Layers`, each layer put with `sharding` (a layer's)."""
    value = np.asarray(value)
    return Layers(tuple(jax.device_put(value[i], sharding) for i in range(value.shape[0])))


def held_paths(stack: nnx.Module) -> tuple[tuple, ...]:
    """The paths, within a stacked layer module, of the weights its modules hold in place (IN_PLACE)."""
    return tuple((*path, name) for path, node in nnx.iter_graph(stack)
                 if isinstance(node, nnx.Module) for name in getattr(type(node), "IN_PLACE", ()))


def hold(params: nnx.State, held: Iterable[tuple]) -> None:
    """Hold each parameter leaf under a path of `held` per layer, in place (the state's variables are
    the model's): one leaf at a time, through the host, so the device holds one extra leaf at most (when
    nothing else holds the stacked leaves)."""
    held = tuple(held)
    for path, var in nnx.to_flat_state(params):
        value = var[...]
        if any(path[:len(prefix)] == prefix for prefix in held) and not isinstance(value, Layers):
            var.set_value(split(value, layer_sharding(value.sharding)))  # the stacked buffer goes with its last reference


def put_like(value: Any, live: Any) -> Any:
    """Host `value` as a new device value shaped as the live leaf `live`: an array with its dtype and
    sharding, or a `Layers` with its layers' (cast as loading casts)."""
    value = np.asarray(value)
    if isinstance(live, Layers):
        return split(value.astype(live.dtype, copy=False), live.parts[0].sharding)
    return jax.device_put(value.astype(live.dtype, copy=False), live.sharding)
