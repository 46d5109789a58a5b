"""Weight products of a few rows on XLA:CPU, by a kernel of our own (config worker.product_kernel):
float32 weights, and int8 ones (layers/quantized.py) converted in registers.

Why. Decode at a small batch reads every weight once per step: its speed is the rate it reads them.
XLA:CPU falls short of it three ways (measured in docs/performance.md): its products of a few rows
read a layer's float32 weight slower than a sum reads it; in the layer scan it first slices each
layer's weight out of the stack into a copy; and it converts an int8 weight to a float32 copy
before its dot, so int8 decode gains far less than its bytes. The kernel (product_kernel.cc, XLA
FFI custom calls) reads each weight once, in order, on XLA's intra-op threads, converting int8
values in registers as it multiplies, and reads a layer's weight where it lies in the stack: the
layer scan hands it the stacked weight whole and the layer's row (layers/decoder.py,
layers/stack_layer.py).

Where. `Numerics.matmul` hands it, through the model's `Kernels` (layers/kernels.py; kernels.py
here), a product that contracts one axis, of float32 activations x [T, I] by w [I, O...] (the
layers' projections; o's two contracted axes merged into one by Numerics) or by w [O, I] (a tied
LM head's table), w float32 or int8 with a scale per output channel. T is at most MAX_ROWS by a
w [I, O...] and TABLE_MAX_ROWS by a table: decode steps, short verify steps and short prefill
chunks. Up to 8 rows the kernel reads w once for all of them; from 9 on the products are
compute-bound, and it splits them by output columns with its sums in registers, still faster than
XLA's matmul, which pays the slice copy. Larger steps scan the weights as before: the kernel over
a long prefill chunk was no faster. Start-up (worker_svc/start.py's `numerics`) turns it on only on
the CPU platform, without a device mesh (a custom call has no sharding rule: GSPMD would gather the
weight), and without batch_invariant (whose fixed-order tiles are XLA's matmuls). Other products,
and training (a custom call has no gradient), keep XLA's.

Numbers. Sums in float32, as XLA's, in another order: logprobs move by float32 rounding (tested
against XLA's product). An output depends on its own row of x and the weights alone, never on the
thread count or the other rows (product_kernel.cc's parts have fixed bounds), nor on whether the
weight came whole or as its layer of a stack.

Building: build.py, once per process (`load`). Without a compiler, or if the build fails, `load`
says why and start-up keeps XLA's products (a warning in the log, not an error).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from worker_svc.cpu_kernels.build import CpuKernel
from worker_svc.layers.quantized import QArray

INT8 = "jaxstream_int8_product"  # the XLA custom call targets: int8 weights, float32 weights
FLOAT32 = "jaxstream_float32_product"
KERNEL = CpuKernel(Path(__file__).with_suffix(".cc"), {INT8: "JaxstreamInt8Product", FLOAT32: "JaxstreamFloat32Product"})
# The most rows of x the kernel takes, measured against XLA's products on SmolLM2's shapes
# (docs/performance.md): 32 by a w [I, O...] (past 8 rows by output columns), 8 by a head's
# table [O, I] (XLA's product reads the table once; the kernel's once per 4 rows of x).
MAX_ROWS = 32
TABLE_MAX_ROWS = 8


def load() -> str:
    """Build (once per process) and register the kernel: "" when it is ready, else why not (one line)."""
    return KERNEL.load()


def product(spec: str, x: jax.Array, w: jax.Array | QArray, row: jax.Array | None = None, **kwargs) -> jax.Array | None:
    """jnp.einsum(spec, x, w) by the kernel (which `load` must have registered), w float32 or an int8
    QArray (quantized.py's, a scale per output channel), or None where it does not apply: see the
    module docstring. With `row` (a traced layer index), w's arrays are a stack [L, ...] and the
    product is with its layer `row`, which the kernel reads where it lies in the stack."""
    values, scale = (w.values, w.scale) if isinstance(w, QArray) else (w, None)
    stacked = 0 if row is None else 1
    if (x.ndim != 2 or x.dtype != jnp.float32 or x.shape[0] > MAX_ROWS
            or values.dtype != (jnp.int8 if isinstance(w, QArray) else jnp.float32)
            or any(k != "preferred_element_type" or jnp.dtype(v) != jnp.float32 for k, v in kwargs.items())):
        return None
    layers, shape = values.shape[:stacked] or (1,), values.shape[stacked:]  # the stack's depth, a layer's shape
    inputs, out = spec.split("->")
    (rows, contracted), w_axes = inputs.split(",")  # x [T, I]
    if len(w_axes) != len(shape) or out[:1] != rows or contracted in out or len(set(w_axes)) != len(w_axes):
        return None
    if w_axes[0] == contracted and out[1:] == w_axes[1:]:  # w [I, O...]
        transposed, outputs = False, shape[1:]
        stack = values.reshape(*layers, shape[0], -1)
    elif len(w_axes) == 2 and w_axes[1] == contracted and out[1:] == w_axes[0]:  # w [O, I]
        if x.shape[0] > TABLE_MAX_ROWS:
            return None
        transposed, outputs = True, shape[:1]
        stack = values.reshape(*layers, *shape)
    else:
        return None
    index = jnp.asarray(0 if row is None else row, jnp.int32)
    y = jax.ShapeDtypeStruct((x.shape[0], int(np.prod(outputs))), jnp.float32)
    if scale is None:
        y = jax.ffi.ffi_call(FLOAT32, y, vmap_method="sequential")(x, stack, index, transposed=transposed)
    else:
        if scale.shape[stacked + w_axes.index(contracted)] != 1 or int(np.prod(scale.shape[stacked:])) != y.shape[1]:
            return None  # not one scale per output channel
        if row is not None:
            scale = jax.lax.dynamic_index_in_dim(scale, row, keepdims=False)  # the layer's (its channels' floats)
        y = jax.ffi.ffi_call(INT8, y, vmap_method="sequential")(x, stack, scale.reshape(-1).astype(jnp.float32), index,
                                                                transposed=transposed)
    return y.reshape(x.shape[0], *outputs)
