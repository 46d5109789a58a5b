"""MoE's grouped matmul (moe=ep) by JAX's TPU megablox kernel (jax.experimental.pallas.ops.tpu.megablox's
`gmm`): jax.lax.ragged_dot's product, rows sorted by expert, each group of rows by its expert's weight.

gmm tiles the rows by TILE_ROWS (padded up to whole tiles here) and the other two axes by TILE
(whole where smaller); it writes only the rows inside some group, so the rows past every group
(the exchange's padding, expert id >= E) are set to 0 here, as ragged_dot leaves them.

Shapes in the legend of worker_svc/__init__.py; here X rows, A in and B out per expert.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import megablox

TILE = 128  # the TPU's lane width: the tile of the contracted and output axes, where they are larger
TILE_ROWS = 128  # rows per tile, at most; fewer rows: one tile of them, a multiple of 8 (the TPU's sublanes)


def applies(rows_dtype, w_dtype) -> bool:
    """Whether gmm takes rows of `rows_dtype` by a weight of `w_dtype`: one float dtype (an int8
    weight's values and scales: ragged_dot's way, layers/quantized.py)."""
    return jnp.dtype(rows_dtype) == jnp.dtype(w_dtype) and jnp.dtype(rows_dtype) in (jnp.float32, jnp.bfloat16)


def grouped_product(rows: jax.Array, w: jax.Array, group_sizes: jax.Array, row_group: jax.Array, interpret: bool) -> jax.Array:
    """rows [X, A] by w [E, A, B], group_sizes [E], each row's group `row_group` [X] -> [X, B]."""
    count, inner = rows.shape
    experts, _, outer = w.shape
    tile_rows = min(TILE_ROWS, -(-count // 8) * 8)
    padded = -(-count // tile_rows) * tile_rows
    tiling = (tile_rows, min(TILE, inner), min(TILE, outer))
    out = megablox.gmm(jnp.pad(rows, ((0, padded - count), (0, 0))), w, group_sizes, preferred_element_type=jnp.float32,
                       tiling=tiling, interpret=interpret)[:count]
    return jnp.where((row_group < experts)[:, None], out, 0).astype(rows.dtype)
