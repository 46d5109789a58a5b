"""`CpuKernels`: the layers' `Kernels` (worker_svc/layers/kernels.py) on XLA:CPU, by this folder's
kernels, each part on or off. Start-up (worker_svc/start.py's `numerics`) builds the parts its
config asks for (`product_kernel.load`, `attention_kernel.load`) and hands the model a CpuKernels
of those that built; a part that is off answers None (or False), and the layers run their own way.

A frozen dataclass: hashable and compared by value, as the model's static Numerics must be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from worker_svc.cpu_kernels import attention_kernel, product_kernel
from worker_svc.layers.kernels import State


@dataclass(frozen=True)
class CpuKernels:
    products: bool = False  # weight products of few rows by product_kernel.py's kernel (registered by its `load`)
    attention: bool = False  # page-list and own-key attention by attention_kernel.py's kernel (registered by its `load`)

    def product(self, spec: str, x: jax.Array, w: Any, row: jax.Array | None = None, **kwargs: Any) -> jax.Array | None:
        return product_kernel.product(spec, x, w, row, **kwargs) if self.products else None

    def reads_stacked_whole(self, rows: int) -> bool:
        return self.products and rows <= product_kernel.MAX_ROWS

    def attends(self, q_dtype: Any, cache_dtype: Any, group: int, head_dim: int) -> bool:
        return self.attention and attention_kernel.applies(q_dtype, cache_dtype, group, head_dim)

    def cached_state(self, q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, layer: jax.Array, pages: jax.Array,
                     cached: jax.Array, lowest: jax.Array | None = None, softcap: float | None = None) -> State | None:
        if not self.attention:
            return None
        return attention_kernel.cached_state(q, cache_k, cache_v, layer, pages, cached, lowest, softcap)

    def grouped_product(self, rows: jax.Array, w: Any, group_sizes: jax.Array, row_group: jax.Array) -> jax.Array | None:
        return None  # XLA:CPU's ragged_dot

    def own_state(self, q: jax.Array, k: jax.Array, v: jax.Array, segment: jax.Array, window: jax.Array | None = None,
                  softcap: float | None = None) -> State | None:
        return attention_kernel.own_state(q, k, v, segment, window, softcap) if self.attention else None
