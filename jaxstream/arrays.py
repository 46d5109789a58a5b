"""numpy arrays <-> `protocol.Array` (raw little-endian bytes, dtype, shape; never pickled)."""

from __future__ import annotations

import numpy as np

from jaxstream.protocol import Array


def to_wire(array: np.ndarray) -> Array:
    array = np.ascontiguousarray(array)
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return Array(little.dtype.str, tuple(array.shape), little.tobytes())


def from_wire(array: Array) -> np.ndarray:
    return np.frombuffer(array.data, dtype=np.dtype(array.dtype)).reshape(array.shape)
