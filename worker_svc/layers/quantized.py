"""int8 weight-only quantization (config worker.quantization=int8): each weight matmul's weight held as
int8 values and one float32 scale per output channel, a quarter of float32's bytes. Decode at small
batches reads every weight once per step and little else, so fewer weight bytes make it faster.

The representation: symmetric, per output channel. For a weight w whose matmul contracts the axes
`contracted`, scale = max |w| over those axes / 127 (keepdims: size 1 on them), values = round(w /
scale) clipped to [-127, 127]; so w ~ values * scale, each element within scale / 2. A channel of
zeros gets scale 1 and values 0 (exact). An expert stack [E, D, F] gets a scale per expert and
output channel; the embedding table [V, D] one per vocabulary row, which is the output channel of
the tied LM head and the unit an embedding lookup reads.

In the parameter tree a quantized weight is an `Int8Weight` module of two nnx.Params in place of
the float Param: `values` (int8, the weight's shape and logical axis names) and `scale` (float32,
the keepdims shape, logical name None on the contracted axes, so a sharding rule never splits an
axis of size 1). So jit, nnx.split/merge, the layer scan, sharding.py and swap.py see plain
arrays. Reading one (`w[...]`, as a Param is read) gives a `QArray`, which `einsum`, `ragged_dot`
and `take` below multiply by, and Numerics.matmul hands to `einsum`: layers do not branch on the
mode.

Arithmetic stays in the activations' dtype (float32 on CPU, bfloat16 on GPU): the int8 values are
converted to it, multiplied, accumulated, and the output channels scaled after the product (exact,
and M x N multiplies instead of K x N) wherever the scale's axes are all in the output; otherwise
(the `fused` MoE's down projection sums over experts, each with its own scales) the weight is
dequantized first. Measured on XLA:CPU (docs/journal.md): the convert is not fused into
the dot there (a float32 copy of each weight is written, from the int8 bytes, into the CPU's cache
and read by the dot), which is why XLA's int8 decode gains less than the 4x in bytes; on CPU the
served worker multiplies few rows by a kernel of its own instead (Numerics.kernels; worker_svc/cpu_kernels/).

Loading (loading.py) and the hot swap (swap.py) quantize on the host, each weight as it is filled,
with `quantize`; `fills` pairs each checkpoint parameter with the leaves it fills.

Shapes in the legend of worker_svc/__init__.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

LIMIT = 127  # symmetric: -127..127, so -w quantizes to -values
# A weight whose converted copy would be larger is multiplied in chunks on XLA:CPU (_converted_product).
# Measured on SmolLM2's head (docs/journal.md): ~2-7 MB chunks alike, whole 10x slower.
CONVERT_CHUNK_BYTES = 4 << 20


class QArray(NamedTuple):
    """An int8 weight as a step reads it."""

    values: jax.Array  # int8, the weight's shape
    scale: jax.Array  # float32, the weight's shape with the contracted axes of size 1

    @property
    def shape(self) -> tuple[int, ...]:  # the weight's, as a float weight's array would tell it
        return self.values.shape


def quantize(w: Any, contracted: Iterable[int]) -> tuple[Any, Any]:
    """(int8 values, float32 scale with keepdims) of float weight `w` (numpy on the host; jax.numpy
    for a jax array, e.g. a model built with random weights) over its `contracted` axes. XLA:CPU's
    divisions are not IEEE-exact (within an ulp), so the two may differ in a rare value or scale."""
    xp = jnp if isinstance(w, jax.Array) else np
    w = w.astype(xp.float32)
    peak = xp.max(xp.abs(w), axis=tuple(contracted), keepdims=True)
    scale = xp.where(peak > 0, peak / LIMIT, xp.float32(1.0))
    values = xp.clip(xp.round(w / scale), -LIMIT, LIMIT).astype(xp.int8)
    return values, scale.astype(xp.float32)


def dequantize(q: QArray, dtype: Any) -> jax.Array:
    """values * scale in float32, then in `dtype`: one rounding, to the weight's nearest."""
    return (q.values.astype(jnp.float32) * q.scale).astype(dtype)


def contracted_axes(scale_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The axes a scale of this shape was taken over: those of size 1. A weight axis of size 1 counts
    too, which changes nothing (the max over one element is that element)."""
    return tuple(i for i, n in enumerate(scale_shape) if n == 1)


class Int8Weight(nnx.Module):
    """A quantized weight in the parameter tree; `w[...]` reads it, as a Param is read."""

    def __init__(self, w: jax.Array, names: tuple[str | None, ...], contracted: tuple[int, ...]) -> None:
        values, scale = quantize(w, contracted)
        self.values = nnx.Param(values, out_sharding=names, eager_sharding=False)
        scale_names = tuple(None if i in contracted else name for i, name in enumerate(names))
        self.scale = nnx.Param(scale, out_sharding=scale_names, eager_sharding=False)

    def __getitem__(self, index: Any) -> QArray:
        return QArray(self.values[index], self.scale[index])


def weight(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, names: tuple[str, ...], contracted: tuple[int, ...],
           dtype: jnp.dtype, quantization: str | None) -> nnx.Param | Int8Weight:
    """A weight matmul's weight, random normal times `std` (a stand-in: loading.py fills every
    weight), as the model dtype's Param, or int8 quantized over its `contracted` axes."""
    w = jax.random.normal(rngs.params(), shape, jnp.float32) * std
    if quantization == "int8":
        return Int8Weight(w, names, contracted)
    return nnx.Param(w.astype(dtype), out_sharding=names, eager_sharding=False)


def einsum(spec: str, x: jax.Array, w: jax.Array | QArray, **kwargs: Any) -> jax.Array:
    """jnp.einsum(spec, x, w) for a two-operand spec; an int8 `w` converted to x's dtype, its scale
    applied to the output where the scale's axes all are output axes, else to the weight first."""
    if not isinstance(w, QArray):
        return jnp.einsum(spec, x, w, **kwargs)
    inputs, out = spec.split("->")
    w_axes = inputs.split(",")[1]
    scaled = [a for a, n in zip(w_axes, w.scale.shape) if n != 1]
    if not all(a in out for a in scaled):
        return jnp.einsum(spec, x, dequantize(w, x.dtype), **kwargs)
    y = _converted_product(spec, x, w.values, **kwargs)
    # The scale's axes, in the output's order, broadcast over the output's other axes.
    keep = [a for a in out if a in w_axes]
    scale = jnp.einsum(f"{w_axes}->{''.join(keep)}", w.scale)  # drops the contracted axes (size 1: exact)
    scale = scale.reshape([w.scale.shape[w_axes.index(a)] if a in w_axes else 1 for a in out])
    return (y * scale).astype(y.dtype)


def _converted_product(spec: str, x: jax.Array, values: jax.Array, **kwargs: Any) -> jax.Array:
    """jnp.einsum(spec, x, values converted to x's dtype). XLA:CPU writes the converted weight out
    before its dot; for a weight whose copy would pass CONVERT_CHUNK_BYTES (SmolLM2's tied head: 113
    MB, converted whole in 53 ms against 8 ms for the float32 product), the product runs in chunks
    of its leading axis, each converted copy staying in the CPU's cache (5 ms). Other backends fuse
    the convert into the product: one einsum."""
    chunks = _chunk_count(values.shape[0], values.size * x.dtype.itemsize)
    if chunks == 1 or jax.default_backend() != "cpu":
        return jnp.einsum(spec, x, values.astype(x.dtype), **kwargs)
    inputs, out = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    lead = w_axes[0]
    parts = values.reshape(chunks, values.shape[0] // chunks, *values.shape[1:])
    if lead in out:  # an output axis: each chunk gives its slice of the output
        ys = jax.lax.map(lambda part: jnp.einsum(spec, x, part.astype(x.dtype), **kwargs), parts)
        at = out.index(lead)
        ys = jnp.moveaxis(ys, 0, at)  # [..., chunks, lead / chunks, ...]
        return ys.reshape(*ys.shape[:at], -1, *ys.shape[at + 2:])
    # A contracted axis: each chunk a partial sum, added in chunk order.
    at = x_axes.index(lead)
    xs = jnp.moveaxis(x.reshape(*x.shape[:at], chunks, -1, *x.shape[at + 1:]), at, 0)

    def add(total: jax.Array, pair: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        x_part, part = pair
        return total + jnp.einsum(spec, x_part, part.astype(x.dtype), **kwargs), None

    first = jnp.einsum(spec, xs[0], parts[0].astype(x.dtype), **kwargs)
    return jax.lax.scan(add, first, (xs[1:], parts[1:]))[0]


def _chunk_count(size: int, nbytes: int) -> int:
    """How many equal chunks of a leading axis of `size` keep each converted chunk near
    CONVERT_CHUNK_BYTES: the least divisor of `size` at or above nbytes / CONVERT_CHUNK_BYTES, if one
    is within 4x of it; else 1 (no chunks: an awkward size converts whole)."""
    least = -(-nbytes // CONVERT_CHUNK_BYTES)
    if least <= 1:
        return 1
    return next((n for n in range(least, min(4 * least, size) + 1) if size % n == 0), 1)


def ragged_dot(rows: jax.Array, w: jax.Array | QArray, group_sizes: jax.Array, row_group: jax.Array) -> jax.Array:
    """jax.lax.ragged_dot(rows [X, A], w [E, A, B], group_sizes [E]) -> [X, B]; an int8 w's scale
    [E, 1, B] applied to each output row by its group `row_group` [X] (a row past every group, id >=
    E, is 0 either way)."""
    if not isinstance(w, QArray):
        return jax.lax.ragged_dot(rows, w, group_sizes)
    y = jax.lax.ragged_dot(rows, w.values.astype(rows.dtype), group_sizes)
    scale = jnp.take(w.scale[:, 0, :], row_group, axis=0, mode="fill", fill_value=0)  # [X, B]
    return (y * scale).astype(y.dtype)


def take(table: jax.Array | QArray, tokens: jax.Array, dtype: Any) -> jax.Array:
    """Rows `tokens` [T] of an embedding table [V, D] -> [T, D] in `dtype`: an int8 table's rows
    dequantized after the lookup (only T rows converted)."""
    if not isinstance(table, QArray):
        return jnp.take(table, tokens, axis=0)
    return dequantize(QArray(jnp.take(table.values, tokens, axis=0), jnp.take(table.scale, tokens, axis=0)), dtype)  # [T, D]


def spec_of(w: jax.Array | QArray, spec: Any) -> Any:
    """The shard_map spec of a weight whose values' spec is `spec` (a PartitionSpec): for an int8
    one, (spec, the scale's: None on its size-1 axes)."""
    if not isinstance(w, QArray):
        return spec
    axes = tuple(spec) + (None,) * (w.scale.ndim - len(spec))
    return QArray(spec, type(spec)(*(None if n == 1 else a for a, n in zip(axes, w.scale.shape))))


def fills(flat: Iterable[tuple[tuple, Any]]) -> Iterator[tuple[tuple, Any, tuple[tuple[tuple, Any], ...]]]:
    """The flat state's parameters as the checkpoint holds them: (the parameter's path, a stand-in
    with its `shape`, the leaves it fills: ((path, var),) for a plain one, (values, scale) for an
    int8 one, both filled from one float tensor). In state order (an Int8Weight's two leaves are
    adjacent there: they are one module's only ones)."""
    flat = list(flat)
    i = 0
    while i < len(flat):
        path, var = flat[i]
        pair = {p[-1]: (p, v) for p, v in flat[i:i + 2] if p[:-1] == path[:-1]}
        if pair.keys() == {"values", "scale"}:
            values = pair["values"]
            yield path[:-1], values[1], (values, pair["scale"])
            i += 2
        else:
            yield path, var, (flat[i],)
            i += 1


def leaf_values(value: np.ndarray, leaves: tuple[tuple[tuple, Any], ...], at: tuple[int, ...] = ()) -> list[np.ndarray]:
    """A parameter's float value (its rows `at`, or whole) as the arrays of its leaves: itself for a
    plain parameter, (values, scale) quantized per output channel for an int8 one."""
    if len(leaves) == 1:
        return [value]
    scale_shape = tuple(leaves[1][1].shape[len(at):])
    return list(quantize(np.asarray(value), contracted_axes(scale_shape)))
