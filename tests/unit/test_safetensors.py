"""jaxstream/safetensors.py against the `safetensors` package both ways, and every malformed input
refused with an error that names what is wrong."""

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors as reference
from safetensors.numpy import load, save

from jaxstream.safetensors import MAX_HEADER_BYTES, SafetensorsError, decode, encode

RNG = np.random.default_rng(0)
TENSORS = {  # every dtype, odd sizes so alignment matters, a scalar and an empty tensor
    "half": RNG.normal(size=(3, 5)).astype(np.float16),
    "bf16": RNG.normal(size=(7,)).astype(ml_dtypes.bfloat16),
    "single": RNG.normal(size=(4, 1)).astype(np.float32),
    "double": RNG.normal(size=(3,)),
    "ids": np.arange(-3, 9, dtype=np.int64).reshape(3, 4),
    "i32": np.arange(5, dtype=np.int32),
    "i16": np.arange(3, dtype=np.int16),
    "i8": np.arange(-2, 3, dtype=np.int8),
    "u64": np.arange(2, dtype=np.uint64),
    "u32": np.arange(3, dtype=np.uint32),
    "u16": np.arange(5, dtype=np.uint16),
    "bytes": np.arange(7, dtype=np.uint8),
    "mask": np.array([True, False, True]),
    "scalar": np.array(2.5, dtype=np.float32),
    "empty": np.zeros((0, 4), dtype=np.float32),
}
WITHOUT_BF16 = {name: array for name, array in TENSORS.items() if array.dtype != ml_dtypes.bfloat16}


def assert_same(got: list[tuple[str, np.ndarray]], expected: dict[str, np.ndarray]) -> None:
    assert sorted(name for name, _ in got) == sorted(expected)
    for name, array in got:
        assert array.dtype == expected[name].dtype and array.shape == expected[name].shape, name
        np.testing.assert_array_equal(array, expected[name], err_msg=name)


# --- both ways with the reference ---


def test_the_reference_reads_what_encode_writes():
    assert_same(list(load(encode(WITHOUT_BF16)).items()), WITHOUT_BF16)
    # safetensors.numpy cannot load BF16; the framework-free reader gives its raw bytes.
    raw = {name: bytes(tensor["data"]) for name, tensor in reference.deserialize(encode(TENSORS))}
    assert raw == {name: array.tobytes() for name, array in TENSORS.items()}


def test_decode_reads_what_the_reference_writes():
    written = save(TENSORS, metadata={"format": "np"})
    assert_same(decode(written), TENSORS)


def test_encode_lays_out_the_data_as_the_reference_does():
    # Widest items first (here each width once, so no tie to break), the header padded alike; only
    # the header's key order differs (ours is the caller's, the reference's the data's).
    tensors = {"w": TENSORS["double"], "b": TENSORS["bf16"], "i": TENSORS["i8"], "f": TENSORS["single"]}
    ours, theirs = encode(tensors, {"k": "v"}), save(tensors, metadata={"k": "v"})
    (length,) = struct.unpack("<Q", ours[:8])
    assert ours[:8] == theirs[:8] and ours[8 + length :] == theirs[8 + length :]
    assert json.loads(ours[8 : 8 + length]) == json.loads(theirs[8 : 8 + length])


def test_round_trip_keeps_order_and_metadata():
    data = encode(TENSORS, {"step": "12"})
    assert [name for name, _ in decode(data)] == list(TENSORS)
    assert_same(decode(data), TENSORS)
    (length,) = struct.unpack("<Q", data[:8])
    assert length % 8 == 0 and json.loads(data[8 : 8 + length])["__metadata__"] == {"step": "12"}


def test_decoded_arrays_are_views_of_aligned_data():
    data = encode(TENSORS)
    for name, array in decode(data):
        assert array.flags.aligned, name
        if array.size:
            assert not array.flags.owndata, name  # a view of `data`, not a copy


def test_unaligned_tensors_are_copied_aligned():
    # A writer that keeps the caller's order puts the float32 at byte 3.
    data = raw_safetensors({"b": entry("U8", [3], 0, 3), "f": entry("F32", [2], 3, 11)},
                           bytes([1, 2, 3]) + np.array([1.5, -2], np.float32).tobytes())
    got = dict(decode(data))
    assert got["f"].flags.aligned and got["f"].tolist() == [1.5, -2]


def test_encode_makes_big_endian_and_strided_arrays_little_endian_and_contiguous():
    big = np.arange(6, dtype=">i4").reshape(2, 3)
    strided = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    got = dict(load(encode({"big": big, "strided": strided})))
    np.testing.assert_array_equal(got["big"], big)
    np.testing.assert_array_equal(got["strided"], strided)


def test_encode_refuses_what_safetensors_cannot_hold():
    with pytest.raises(ValueError, match="tensor 'c' has dtype complex64"):
        encode({"ok": np.zeros(2), "c": np.zeros(2, np.complex64)})
    with pytest.raises(ValueError, match="tensor 's' has dtype <U1"):
        encode({"s": np.array(["a"])})
    with pytest.raises(ValueError, match="'__metadata__' cannot be used"):
        encode({"__metadata__": np.zeros(2)})
    with pytest.raises(ValueError, match="metadata maps strings to strings"):
        encode({"w": np.zeros(2)}, {"step": 3})


# --- malformed bytes ---


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def raw_safetensors(header: dict | str, data: bytes) -> bytes:
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    return struct.pack("<Q", len(text)) + text + data


F32_4 = bytes(16)
MALFORMED = {  # bytes -> the error's message (a regular expression)
    "short": (b"\x01\x00", r"truncated \(2 bytes; safetensors starts with an 8-byte header length\)"),
    "cut header": (encode({"w": np.zeros(4, np.float32)})[:20], r"truncated or not safetensors \(a \d+-byte header"),
    "absurd length": (struct.pack("<Q", MAX_HEADER_BYTES + 1) + bytes(64), "truncated or not safetensors"),
    "not json": (raw_safetensors("{not json", b""), "the safetensors header is not JSON"),
    "not utf-8": (struct.pack("<Q", 2) + b"\xff\xfe", "the safetensors header is not JSON"),
    "a list": (raw_safetensors("[1, 2]", b""), "the safetensors header is not a JSON object"),
    "bad metadata": (raw_safetensors({"__metadata__": {"step": 3}}, b""), "__metadata__ is not an object of strings"),
    "twice": (raw_safetensors('{"w": {}, "w": {}}', b""), "the safetensors header names 'w' twice"),
    "no offsets": (raw_safetensors({"w": {"dtype": "F32", "shape": [4]}}, F32_4),
                   "tensor 'w' has a malformed header entry"),
    "not an object": (raw_safetensors({"w": [1, 2]}, F32_4), "tensor 'w' has a malformed header entry"),
    "negative": (raw_safetensors({"w": entry("F32", [-4], 0, 16)}, F32_4), "tensor 'w' has a malformed header entry"),
    "bool dim": (raw_safetensors({"w": entry("F32", [True], 0, 4)}, bytes(4)),
                 "tensor 'w' has a malformed header entry"),
    "reversed": (raw_safetensors({"w": entry("F32", [0], 8, 4)}, F32_4), "tensor 'w' has a malformed header entry"),
    "wrong size": (raw_safetensors({"w": entry("F32", [8], 0, 16)}, F32_4),
                   r"tensor 'w' holds 16 bytes, but F32 \[8\] needs 32"),
    "past the end": (raw_safetensors({"w": entry("F32", [4], 0, 16)}, bytes(12)),
                     "truncated: tensor 'w' ends at byte 16 of 12 data bytes"),
    "overlap": (raw_safetensors({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, bytes(12)),
                r"tensor 'b' \(bytes 4..12\) overlaps tensor 'a', which ends at byte 8"),
    "gap": (raw_safetensors({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, bytes(12)),
            r"tensor 'b' starts at byte 8, leaving bytes 4..8 to no tensor"),
    "left over": (raw_safetensors({"w": entry("F32", [4], 0, 16)}, bytes(20)),
                  r"bytes 16..20 of the data, after the last tensor, belong to no tensor"),
    "unsupported": (raw_safetensors({"w": entry("F8_E4M3", [4], 0, 4)}, bytes(4)),
                    "tensor 'w' has dtype F8_E4M3, which is not supported"),
    # Past what Python's parser or numpy takes: a worker answered these "the worker failed: ..." (issue 41)
    "nested": (raw_safetensors("[" * 100_000, b""), "the safetensors header is not JSON"),
    "huge integer": (raw_safetensors('{"w": {"dtype": "F32", "shape": [1' + "0" * 5000 + '], "data_offsets": [0, 0]}}', b""),
                     "the safetensors header is not JSON"),
    "too many dimensions": (raw_safetensors({"w": entry("F32", [0] * 40, 0, 0)}, b""),
                            r"tensor 'w' has a shape no array can have: 40 dimensions \(at most 32\)"),
    "dimension past int64": (raw_safetensors({"w": entry("F32", [2**64, 0], 0, 0)}, b""),
                             "tensor 'w' has a shape no array can have"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_bytes_are_refused_naming_the_fault(case):
    data, message = MALFORMED[case]
    with pytest.raises(SafetensorsError, match=message):
        decode(data)


def test_the_reference_refuses_what_decode_refuses():
    # The strictness is the reference's, not ours: it too wants every data byte in exactly one tensor.
    for case in ("overlap", "gap", "left over", "past the end", "wrong size"):
        with pytest.raises(reference.SafetensorError):
            reference.deserialize(MALFORMED[case][0])


def test_decode_takes_a_memoryview_and_a_bytearray():
    data = encode(WITHOUT_BF16)
    assert_same(decode(memoryview(data)), WITHOUT_BF16)
    assert_same(decode(bytearray(data)), WITHOUT_BF16)
