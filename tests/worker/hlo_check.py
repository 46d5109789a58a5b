"""What the worker tests read in compiled HLO text (`jax.stages.Compiled.as_text()`): copies of a
cache-sized array or of a cache array's own shape, and writes of a layer weight, the two copies
issue 21 removed from every step."""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np

# Instructions that name an array without writing it.
NAMING = ("parameter", "get-tuple-element", "bitcast", "tuple", "constant")


def full_copies(hlo: str, elems: int) -> list[str]:
    """Instructions that copy an array of at least `elems` elements (any dtype)."""
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= \w+\[([\d,]+)\][^ ]* copy\(", line)
        if m and np.prod([int(d) for d in m.group(1).split(",")]) >= elems:
            found.append(line.strip())
    return found


def copies_of(hlo: str, shapes: Iterable[tuple[int, ...]]) -> list[str]:
    """Instructions that copy an array of one of `shapes` exactly (a whole cache array, where smaller
    arrays of as many elements are the step's own)."""
    shapes = {tuple(shape) for shape in shapes}
    return [line for line in full_copies(hlo, min(int(np.prod(s)) for s in shapes))
            if tuple(int(d) for d in re.search(r"\[([\d,]+)\]", line).group(1).split(",")) in shapes]


def weight_writes(hlo: str, shapes: Iterable[tuple[int, ...]]) -> list[str]:
    """Instructions that write out a float32 or int8 array of one of `shapes` (layer weights) in any
    axis order, or flattened (a dynamic-slice, copy, transpose or fusion of it), not those that name
    one (NAMING)."""
    shapes = list(shapes)
    sizes = {tuple(sorted(d for d in shape if d > 1)) for shape in shapes} | {(int(np.prod(s)),) for s in shapes}
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= (?:f32|s8)\[([\d,]+)\][^ ]* ([\w-]+)\(", line)
        if m and m.group(2) not in NAMING:
            if tuple(sorted(int(d) for d in m.group(1).split(",") if int(d) > 1)) in sizes:
                found.append(line.strip())
    return found
