"""int8 weight products of a few rows on XLA:CPU, by a kernel of our own (config worker.int8_kernel).

Why. Decode at a small batch reads every weight once per step, so int8 weights (quantized.py) should
make it up to 4x faster than float32. XLA:CPU does not get there: it converts the int8 values to a
float32 copy before its dot, and multiplies that (benchmarks/DEVELOPERS.md measured int8 decode at
~1.7x float32's speed, its products reading ~6.5 GB/s of int8). The kernel (int8_kernel.cc, an XLA
FFI custom call) converts the values in registers as it multiplies, splits the work over XLA's
intra-op threads, and reads a weight near memory bandwidth.

Where. `Numerics.matmul` hands it an int8 product whose activations are float32 with at most
MAX_ROWS rows (decode and short verify steps; larger steps are compute-bound, where XLA's matmul is
faster), contracting one axis: x [T, I] by w [I, O...] (the layers' projections; o's two
contracted axes merged into one by Numerics, as for weights held in place) or by w [O, I] (a tied
LM head's table). The engine turns it on (start.py's `numerics`) only on the CPU platform, without
a device mesh (a custom call has no sharding rule: GSPMD would gather the weight), and without
batch_invariant (whose fixed-order tiles are XLA's matmuls). Other products, and training (a
custom call has no gradient), keep XLA's.

Numbers. Sums in float32, as XLA's, in another order: logprobs move by float32 rounding (tested
against XLA's product). An output depends on its own row of x and the weights alone, never on the
thread count or the other rows (int8_kernel.cc's parts have fixed bounds).

Building: cpu_kernel.py, once per process (`load`). Without a compiler, or if the build fails, `load`
says why and the engine keeps XLA's products (a warning in the log, not an error).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from worker_svc.layers.cpu_kernel import CpuKernel

TARGET = "jaxstream_int8_product"
KERNEL = CpuKernel(Path(__file__).with_suffix(".cc"), {TARGET: "JaxstreamInt8Product"})
MAX_ROWS = 8  # measured against XLA's int8 product on SmolLM2's shapes: benchmarks/DEVELOPERS.md


def load() -> str:
    """Build (once per process) and register the kernel: "" when it is ready, else why not (one line)."""
    return KERNEL.load()


def product(spec: str, x: jax.Array, values: jax.Array, scale: jax.Array, **kwargs) -> jax.Array | None:
    """jnp.einsum(spec, x, values * scale) by the kernel (which `load` must have registered), or None
    where it does not apply: see the module docstring. `scale` is quantized.py's, per output channel."""
    if (x.ndim != 2 or x.dtype != jnp.float32 or x.shape[0] > MAX_ROWS or values.dtype != jnp.int8
            or any(k != "preferred_element_type" or jnp.dtype(v) != jnp.float32 for k, v in kwargs.items())):
        return None
    inputs, out = spec.split("->")
    (row, contracted), w_axes = inputs.split(",")  # x [T, I]
    if out[:1] != row or contracted in out or len(set(w_axes)) != len(w_axes):
        return None
    if w_axes[0] == contracted and out[1:] == w_axes[1:]:  # w [I, O...]
        transposed, outputs = False, values.shape[1:]
        w = values.reshape(values.shape[0], -1)
    elif len(w_axes) == 2 and w_axes[1] == contracted and out[1:] == w_axes[0]:  # w [O, I]
        transposed, outputs = True, values.shape[:1]
        w = values
    else:
        return None
    if scale.shape[w_axes.index(contracted)] != 1 or scale.size != int(np.prod(outputs)):
        return None  # not one scale per output channel
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], scale.size), jnp.float32), vmap_method="sequential")
    y = call(x, w, scale.reshape(-1).astype(jnp.float32), transposed=transposed)
    return y.reshape(x.shape[0], *outputs)
