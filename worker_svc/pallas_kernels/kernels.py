"""`PallasKernels`: the layers' `Kernels` (worker_svc/layers/kernels.py) by JAX's Pallas kernels,
each part on or off: `attention` (attention.py, the GPU's: over the cache and over a step's own
keys), `grouped` (grouped.py, the TPU's megablox: MoE's grouped matmul); no weight products (XLA's
own, on an accelerator, are the fast ones). `interpret`: run them in Pallas' interpret mode (on a
CPU: the same arithmetic, slowly), rather than compiled for their device.

A frozen dataclass: hashable and compared by value, as the model's static Numerics must be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from worker_svc.layers.kernels import State
from worker_svc.pallas_kernels import attention, grouped


@dataclass(frozen=True)
class PallasKernels:
    attention: bool = True
    grouped: bool = False
    interpret: bool = False

    def product(self, spec: str, x: jax.Array, w: Any, row: jax.Array | None = None, **kwargs: Any) -> jax.Array | None:
        return None

    def reads_stacked_whole(self, rows: int) -> bool:
        return False

    def attends(self, q_dtype: Any, cache_dtype: Any, group: int, head_dim: int) -> bool:
        return self.attention and attention.applies(q_dtype, cache_dtype, head_dim)

    def cached_state(self, q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, layer: jax.Array, pages: jax.Array,
                     cached: jax.Array, lowest: jax.Array | None = None, softcap: float | None = None) -> State | None:
        if not self.attention or lowest is not None or not attention.applies(q.dtype, cache_k.dtype, q.shape[-1]):  # a window: the kernel has none
            return None
        return attention.cached_state(q, cache_k, cache_v, layer, pages, cached, softcap, self.interpret)

    def grouped_product(self, rows: jax.Array, w: Any, group_sizes: jax.Array, row_group: jax.Array) -> jax.Array | None:
        if not self.grouped or not isinstance(w, jax.Array) or not grouped.applies(rows.dtype, w.dtype):
            return None
        return grouped.grouped_product(rows, w, group_sizes, row_group, self.interpret)

    def own_state(self, q: jax.Array, k: jax.Array, v: jax.Array, segment: jax.Array, window: jax.Array | None = None,
                  softcap: float | None = None) -> State | None:
        if not self.attention or window is not None or not attention.own_applies(q.shape[0], softcap):
            return None
        return attention.own_state(q, k, v, segment, self.interpret)
