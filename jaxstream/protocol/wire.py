"""How a message travels: msgpack, decoded by one typed decoder per stream; arrays as raw bytes."""

from __future__ import annotations

import msgspec


class Array(msgspec.Struct, frozen=True, array_like=True):
    """An n-d array as raw little-endian bytes. Convert with `jaxstream.arrays`."""

    dtype: str  # numpy dtype string, e.g. "<i4"
    shape: tuple[int, ...]
    data: bytes


def decoder(union: object) -> msgspec.msgpack.Decoder:
    """The one typed decoder of a stream's union."""
    return msgspec.msgpack.Decoder(union)


encode = msgspec.msgpack.Encoder().encode
