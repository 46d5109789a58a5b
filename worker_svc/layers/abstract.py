"""np.full's abstract twin, so a group of per-step device inputs declares its fields once.

Each group (PagedContext, SamplingInputs, PenaltyInputs, batch.StepInputs, batch.ScoreInputs) has
one `padded(..., full=np.full)` constructor naming every field's shape, dtype and padding value: the
packer fills its rows into that, and `shapes` calls it with the `full` below for the
jax.ShapeDtypeStruct tree the engine lowers with. So what is lowered is what is fed, by construction.
"""

from __future__ import annotations

import jax


def full(shape: int | tuple[int, ...], fill: object, dtype: object) -> jax.ShapeDtypeStruct:
    """The shape and dtype np.full(shape, fill, dtype) would have; `fill` is ignored."""
    return jax.ShapeDtypeStruct(shape if isinstance(shape, tuple) else (shape,), dtype)
