"""A small safetensors reader: numpy only, one memory-mapped tensor per read.

The format (https://github.com/huggingface/safetensors):

    [8 bytes]  N, the header's length, unsigned little-endian
    [N bytes]  JSON: {"name": {"dtype": "BF16", "shape": [out, in], "data_offsets": [begin, end]},
                      ..., "__metadata__": {str: str}}  (optional)
    [rest]     the tensors' bytes, little-endian, row-major; offsets count from the end of the header

`open_safetensors` reads and checks the header only (every tensor's bytes lie inside the file and
match its shape and dtype); `read` maps one tensor's bytes and copies them out.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from worker_svc.weights import CheckpointError

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
# A header bigger than this is a corrupt length word, not a header (safetensors itself caps at 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    dtype: str  # the safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


@dataclass(frozen=True)
class SafetensorsFile:
    path: Path
    tensors: dict[str, TensorEntry] = field(repr=False)
    metadata: dict[str, str] = field(repr=False)

    def read(self, name: str) -> np.ndarray:
        entry = self.tensors.get(name)
        if entry is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        dtype = DTYPES.get(entry.dtype)
        if dtype is None:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has dtype {entry.dtype}, which is not supported "
                f"(supported: {', '.join(DTYPES)})"
            )
        if entry.end == entry.start:  # numpy cannot map zero bytes
            return np.empty(entry.shape, dtype)
        mapped = np.memmap(self.path, dtype=dtype, mode="r", offset=entry.start, shape=(math.prod(entry.shape),))
        return np.array(mapped).reshape(entry.shape)


def open_safetensors(path: Path) -> SafetensorsFile:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such safetensors file")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated ({size} bytes; safetensors starts with an 8-byte header length)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise CheckpointError(f"{path}: truncated or not safetensors ({header_len}-byte header, {size}-byte file)")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: the safetensors header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    tensors = {name: _entry(path, name, info, data_start, size) for name, info in header.items()}
    return SafetensorsFile(path, tensors, metadata)


def _entry(path: Path, name: str, info: object, data_start: int, file_size: int) -> TensorEntry:
    try:
        dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
    except (TypeError, KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from e
    if not all(isinstance(n, int) and n >= 0 for n in (*shape, begin, end)) or begin > end:
        raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {info!r}")
    if data_start + end > file_size:
        raise CheckpointError(
            f"{path}: truncated: tensor {name!r} ends at byte {data_start + end} of a {file_size}-byte file"
        )
    if dtype in DTYPES and end - begin != math.prod(shape) * DTYPES[dtype].itemsize:
        raise CheckpointError(
            f"{path}: tensor {name!r} holds {end - begin} bytes, but {dtype} {list(shape)} needs "
            f"{math.prod(shape) * DTYPES[dtype].itemsize}"
        )
    return TensorEntry(dtype, shape, data_start + begin, data_start + end)
