"""The safetensors format in memory: `encode` arrays to bytes, `decode` bytes to arrays, and the
header parsing that the checkpoint reader (worker_svc/weights/safetensors_file.py) shares.

    [8 bytes]  N, the header's length, unsigned little-endian
    [N bytes]  JSON: {"name": {"dtype": "BF16", "shape": [out, in], "data_offsets": [begin, end]},
                      ..., "__metadata__": {str: str}}  (optional); padded with spaces to a multiple of 8
    [rest]     the tensors' bytes, little-endian, row-major; offsets count from the end of the header

Weights pushed over HTTP travel in this format because checkpoints already are in it: nothing is
pickled, a reader checks every byte before using it, and the `safetensors` package reads what
`encode` writes and writes what `decode` reads. `decode` is as strict as that package's reader:
the tensors cover the data exactly, with no gap, overlap or byte left over.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np

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
CODES: dict[np.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}
MAX_DIMS = 32  # numpy 1's limit on an array's dimensions (numpy 2's is 64)
INT64_MAX = 2**63 - 1  # numpy's limit on one dimension
# A header bigger than this is a corrupt length word, not a header (safetensors itself caps at 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024
METADATA = "__metadata__"  # the header's one key that is not a tensor


class SafetensorsError(ValueError):
    """Bytes that are not valid safetensors; the message names the tensor at fault, where one is."""


@dataclass(frozen=True)
class Entry:
    dtype: str  # the safetensors code, e.g. "BF16"; one DTYPES lacks is refused only when read
    shape: tuple[int, ...]
    begin: int  # byte offsets from the end of the header
    end: int


@dataclass(frozen=True)
class Header:
    tensors: dict[str, Entry]  # in the header's order
    metadata: dict[str, str]


# --- encode ---


def encode(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    """The safetensors bytes of `tensors` (the header lists them in the mapping's order)."""
    arrays = {name: _little_endian(name, array) for name, array in tensors.items()}
    # Widest items first, as the reference writer lays them out: the data starts 8-byte aligned, so
    # every tensor then starts aligned to its item size and `decode` can view it without a copy.
    layout = sorted(arrays.items(), key=lambda item: -item[1].itemsize)
    offsets, at = {}, 0
    for name, array in layout:
        offsets[name], at = [at, at + array.nbytes], at + array.nbytes
    header = {METADATA: _checked_metadata(metadata)} if metadata else {}
    for name, array in arrays.items():
        header[name] = {"dtype": CODES[array.dtype], "shape": list(array.shape), "data_offsets": offsets[name]}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    # One copy of each tensor, straight into the result: join reads each array's buffer.
    return b"".join([struct.pack("<Q", len(text)), text, *(array.reshape(-1).view(np.uint8) for _, array in layout)])


def _little_endian(name: str, array: np.ndarray) -> np.ndarray:
    if not isinstance(name, str) or name == METADATA:
        raise ValueError(f"tensor name {name!r} cannot be used: names are strings other than {METADATA!r}")
    array = np.asarray(array, order="C")
    little = array.dtype.newbyteorder("<")
    if little not in CODES:
        raise ValueError(f"tensor {name!r} has dtype {array.dtype}, which safetensors cannot hold here "
                         f"(supported: {', '.join(str(d) for d in DTYPES.values())})")
    return array.astype(little, copy=False)


def _checked_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    if not all(isinstance(key, str) and isinstance(value, str) for key, value in metadata.items()):
        raise ValueError(f"safetensors metadata maps strings to strings, got {dict(metadata)!r}")
    return dict(metadata)


# --- decode ---


def decode(data: bytes | bytearray | memoryview) -> list[tuple[str, np.ndarray]]:
    """Every tensor in `data`, in the header's order, each checked before it is read.

    An array is a view of `data` where its bytes are aligned (read-only when `data` is bytes; the
    view keeps `data` alive), else an aligned copy."""
    view = memoryview(data).cast("B")
    header, start = read_header(view)
    return [(name, _array(view, name, entry, start)) for name, entry in header.tensors.items()]


def read_header(view: memoryview) -> tuple[Header, int]:
    """The header of the safetensors bytes `view`, checked against the data's layout, and where the
    data starts: all of `decode`'s checks but the arrays' own (a gateway's look before it stores them)."""
    start = 8 + header_length(view[:8], view.nbytes)
    header = parse_header(view[8:start])
    check_layout(header, view.nbytes - start)
    return header, start


def _array(view: memoryview, name: str, entry: Entry, start: int) -> np.ndarray:
    dtype = dtype_of(name, entry.dtype)
    array = np.frombuffer(view, dtype, count=math.prod(entry.shape), offset=start + entry.begin)
    return (array if array.flags.aligned else array.copy()).reshape(entry.shape)


def dtype_of(name: str, code: str) -> np.dtype:
    """The numpy dtype of safetensors code `code`, or an error naming tensor `name` when DTYPES has none."""
    if code not in DTYPES:
        raise SafetensorsError(f"tensor {name!r} has dtype {code}, which is not supported "
                               f"(supported: {', '.join(DTYPES)})")
    return DTYPES[code]


# --- the header, shared with the checkpoint reader ---


def header_length(prefix: bytes | memoryview, size: int) -> int:
    """N, from the first 8 bytes of `size` bytes in all, checked to fit in them."""
    if len(prefix) < 8:
        raise SafetensorsError(f"truncated ({size} bytes; safetensors starts with an 8-byte header length)")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise SafetensorsError(f"truncated or not safetensors (a {length}-byte header in {size} bytes)")
    return length


def parse_header(raw: bytes | memoryview) -> Header:
    """The header's tensors and metadata, each entry well formed and its size matching its shape."""
    try:
        header = json.loads(str(raw, "utf-8"), object_pairs_hook=_unique_keys)
    except SafetensorsError:
        raise
    except (ValueError, RecursionError) as e:  # not UTF-8 or JSON; an integer of more digits than Python reads; nesting past its recursion limit
        raise SafetensorsError(f"the safetensors header is not JSON ({str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise SafetensorsError("the safetensors header is not a JSON object")
    metadata = header.pop(METADATA, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
        raise SafetensorsError(f"the safetensors {METADATA} is not an object of strings: {metadata!r}")
    return Header({name: _entry(name, info) for name, info in header.items()}, metadata)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    # json.loads would keep the last of two same-named tensors silently.
    found = {}
    for key, value in pairs:
        if key in found:
            raise SafetensorsError(f"the safetensors header names {key!r} twice")
        found[key] = value
    return found


def _entry(name: str, info: object) -> Entry:
    try:
        dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
    except (TypeError, KeyError, ValueError) as e:
        raise SafetensorsError(f"tensor {name!r} has a malformed header entry {info!r}") from e
    # type() is int, not isinstance: JSON's true would pass as 1.
    if not isinstance(dtype, str) or not all(type(n) is int and n >= 0 for n in (*shape, begin, end)) or begin > end:
        raise SafetensorsError(f"tensor {name!r} has a malformed header entry {info!r}")
    if len(shape) > MAX_DIMS or any(n > INT64_MAX for n in shape):  # numpy's own limits, which a 0 elsewhere lets by
        raise SafetensorsError(f"tensor {name!r} has a shape no array can have: {len(shape)} dimensions (at most {MAX_DIMS}), "
                               f"the largest {max(shape)} (at most {INT64_MAX})")
    if dtype in DTYPES and end - begin != math.prod(shape) * DTYPES[dtype].itemsize:
        raise SafetensorsError(f"tensor {name!r} holds {end - begin} bytes, but {dtype} {list(shape)} needs "
                               f"{math.prod(shape) * DTYPES[dtype].itemsize}")
    return Entry(dtype, shape, begin, end)


def check_layout(header: Header, data_bytes: int) -> None:
    """The tensors cover the `data_bytes` after the header exactly, as the reference reader demands."""
    at, previous = 0, None
    for name, entry in sorted(header.tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.end > data_bytes:
            raise SafetensorsError(f"truncated: tensor {name!r} ends at byte {entry.end} of {data_bytes} data bytes")
        if entry.begin < at:
            raise SafetensorsError(f"tensor {name!r} (bytes {entry.begin}..{entry.end}) overlaps tensor "
                                   f"{previous!r}, which ends at byte {at}")
        if entry.begin > at:
            raise SafetensorsError(f"tensor {name!r} starts at byte {entry.begin}, leaving bytes {at}..{entry.begin} "
                                   "to no tensor")
        at, previous = entry.end, name
    if at != data_bytes:
        raise SafetensorsError(f"bytes {at}..{data_bytes} of the data, after the last tensor, belong to no tensor")
