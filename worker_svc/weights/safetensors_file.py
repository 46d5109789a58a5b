"""A small safetensors reader: numpy only, one memory-mapped tensor per read.

The format, its dtypes and its header are jaxstream/safetensors.py's; this module adds the file:
`open_safetensors` reads and checks the header only (every tensor's bytes lie inside the file and
match its shape and dtype); `read` maps one tensor's bytes and copies them out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jaxstream import safetensors
from jaxstream.safetensors import SafetensorsError
from worker_svc.weights import CheckpointError


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
        try:
            dtype = safetensors.dtype_of(name, entry.dtype)
        except SafetensorsError as e:
            raise CheckpointError(f"{self.path}: {e}") from e
        if entry.end == entry.start:  # numpy cannot map zero bytes
            return np.empty(entry.shape, dtype)
        mapped = np.memmap(self.path, dtype=dtype, mode="r", offset=entry.start, shape=(math.prod(entry.shape),))
        return np.array(mapped).reshape(entry.shape)


def open_safetensors(path: Path) -> SafetensorsFile:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such safetensors file")
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            data_start = 8 + safetensors.header_length(f.read(8), size)
            header = safetensors.parse_header(f.read(data_start - 8))
    except SafetensorsError as e:
        raise CheckpointError(f"{path}: {e}") from e
    tensors = {name: _entry(path, name, entry, data_start, size) for name, entry in header.tensors.items()}
    return SafetensorsFile(path, tensors, header.metadata)


def _entry(path: Path, name: str, entry: safetensors.Entry, data_start: int, file_size: int) -> TensorEntry:
    # Only inside the file, not the whole-coverage check of `safetensors.decode`: a reader that
    # maps tensors one by one need not refuse a file with a gap between them.
    if data_start + entry.end > file_size:
        raise CheckpointError(
            f"{path}: truncated: tensor {name!r} ends at byte {data_start + entry.end} of a {file_size}-byte file"
        )
    return TensorEntry(entry.dtype, entry.shape, data_start + entry.begin, data_start + entry.end)
