"""A GGUF file's header: its key-value metadata and its tensor table, not the tensors' data.

`gguf.GGUFReader` makes a numpy view of every part of every field: on the bundled SmolLM2 that is
~250k views for the tokenizer's 49152 tokens and 48900 merges, ~3 s of the start-up of every
process that reads its tokenizer or its weights. This reads the same values
(`ReaderField.contents()`'s: str, int, float, bool, and lists of them) straight from the bytes, in a
tenth of that; the worker's loader maps the tensors' data itself (worker_svc/weights/gguf_file.py).

The layout (GGUF versions 2 and 3, either byte order): magic "GGUF", version u32, tensor count u64,
key-value count u64, then per pair a key (u64 length, UTF-8), a value type u32 and the value; a
string is a u64 length and UTF-8, an array an element type u32, a u64 count and the elements. Then
per tensor its name (a string), a dimension count u32, the dimensions (u64 each, the fastest axis
first), its ggml type u32 and its data's offset u64 from the data section, which starts at the next
multiple of `general.alignment` (32 when the file names none) after the table.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
STRING, ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
NUMBERS = {  # value type -> numpy dtype (without byte order)
    0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8", 11: "i8", 12: "f8",
}


class GGUFError(ValueError):
    """Not a GGUF file, a version this cannot read, or one cut short within its header."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # as GGUF lists them: the fastest axis first (numpy's shape reversed)
    ggml_type: int  # gguf.GGMLQuantizationType's value
    offset: int  # of its data, from the file's start


@dataclass(frozen=True)
class Header:
    metadata: dict[str, Any]  # every key-value pair, in file order
    tensors: list[TensorInfo]
    byte_order: str  # "<" or ">", as struct spells it


def read_metadata(path: Path | str) -> dict[str, Any]:
    """Every key-value pair of the file's metadata, in file order."""
    return _read(path, tensors=False).metadata


def read_header(path: Path | str) -> Header:
    return _read(path, tensors=True)


def _read(path: Path | str, tensors: bool) -> Header:
    with open(path, "rb") as f:
        if not f.seek(0, 2):
            raise GGUFError(f"{path}: an empty file, not a GGUF one")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(path, data, tensors)


def _parse(path: Path | str, data: mmap.mmap, tensors: bool) -> Header:
    try:
        parser = _Parser(data)
        metadata = parser.metadata()
        table = parser.tensors(metadata) if tensors else []
        return Header(metadata, table, parser.order)
    except (struct.error, IndexError, ValueError) as exc:  # cut short, a length past the end, bad UTF-8
        if isinstance(exc, GGUFError):
            raise GGUFError(f"{path}: {exc}") from None
        raise GGUFError(f"{path}: not a GGUF file, or one cut short within its header ({exc})") from None


class _Parser:
    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.at = 0
        if data[:4] != MAGIC:
            raise GGUFError("not a GGUF file (no GGUF magic)")
        version = int.from_bytes(data[4:8], "little")
        self.order = "<"
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            version = int.from_bytes(data[4:8], "big")
            self.order = ">"
        if version not in VERSIONS:
            raise GGUFError(f"GGUF version {version} (this reads versions {', '.join(map(str, VERSIONS))})")
        self.at = 8
        self.tensor_count, self.pair_count = self.unpack("QQ")

    def metadata(self) -> dict[str, Any]:
        out = {}
        for _ in range(self.pair_count):
            key = self.string()
            out[key] = self.value(self.unpack("I")[0])
        return out

    def tensors(self, metadata: dict[str, Any]) -> list[TensorInfo]:
        """The tensor table, which follows the metadata (read first)."""
        table = []
        for _ in range(self.tensor_count):
            name = self.string()
            (rank,) = self.unpack("I")
            dims = self.unpack("Q" * rank)
            ggml_type, offset = self.unpack("IQ")
            table.append((name, dims, ggml_type, offset))
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"general.alignment {alignment!r} is not a power of two")
        start = -(-self.at // alignment) * alignment
        names = [t[0] for t in table]
        if len(set(names)) != len(names):
            raise GGUFError(f"a tensor name appears twice: {next(n for n in names if names.count(n) > 1)!r}")
        return [TensorInfo(name, tuple(dims), ggml_type, start + offset) for name, dims, ggml_type, offset in table]

    def unpack(self, fmt: str) -> tuple:
        fmt = self.order + fmt
        values = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        end = self.at + length
        if end > len(self.data):
            raise GGUFError(f"a string of {length} bytes runs past the end of the file")
        text = self.data[self.at:end].decode("utf-8")
        self.at = end
        return text

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            element, count = self.unpack("IQ")
            if element == STRING:
                return [self.string() for _ in range(count)]
            return self.numbers(element, count)
        return self.numbers(kind, 1)[0]

    def numbers(self, kind: int, count: int) -> list:
        """As Python values: a view into the map would keep it from closing."""
        if kind not in NUMBERS:
            raise GGUFError(f"unknown GGUF value type {kind}")  # nested arrays too: no reader makes them
        dtype = np.dtype(NUMBERS[kind]).newbyteorder(self.order)
        values = np.frombuffer(self.data, dtype, count, self.at)
        self.at += values.nbytes
        return values.tolist()
