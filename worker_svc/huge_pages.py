"""Weights on 2 MB pages (worker.huge_pages): on Linux, the CPU buffers of the weights are asked
to be backed by transparent huge pages, so decode reads them faster.

Why. Decode at a small batch is its weight reads (docs/journal.md). XLA:CPU allocates a
weight's buffer on the system's 4 KB pages: where transparent huge pages are "madvise" (a common
default), only memory that asks for 2 MB pages gets them. Reading 538 MB of 4 KB pages crosses
131,000 pages a step, each an address translation the CPU's TLB (a few thousand entries) does not
hold. On 2 MB pages decode steps ran faster (docs/performance.md; docs/journal.md, "Weights on
2 MB pages").

How. The 2 MB-aligned span inside each buffer of 2 MB or more (never a page outside it) is advised
MADV_HUGEPAGE (memory it gains later comes as 2 MB pages), then MADV_COLLAPSE (Linux 6.1+: its
pages are moved onto 2 MB pages now, in place). Both are hints: values and addresses stay as they
are, XLA sees nothing, and where the kernel declines (before 6.1, huge pages "never", no free 2 MB
runs of memory) the weights stay on 4 KB pages and `on_huge_pages` says why. Only CPU buffers are
advised: device memory (GPU, TPU) has pages of its own.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import jax

PAGE = 2 << 20  # the x86-64 and arm64 (4 KB base) transparent huge page
MADV_HUGEPAGE = 14  # <asm-generic/mman-common.h>
MADV_COLLAPSE = 25
SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@dataclass(frozen=True)
class HugePages:
    """What `on_huge_pages` did: `granted` bytes on 2 MB pages, of `asked` bytes asked for; `why` (one line) when
    some were declined."""

    granted: int = 0
    asked: int = 0
    why: str = ""


def on_huge_pages(tree: Any) -> HugePages:
    """Ask for the CPU buffers of the arrays in `tree` (a pytree) to be on 2 MB pages; see the module
    docstring. Buffers already on them cost a check each."""
    if not sys.platform.startswith("linux"):
        return HugePages(why=f"huge pages are asked for on Linux only (this is {sys.platform})")
    madvise = _madvise()
    done = asked = 0
    why = ""
    for start, length in _spans(jax.tree.leaves(tree)):
        asked += length
        for advice in (MADV_HUGEPAGE, MADV_COLLAPSE):
            if madvise(start, length, advice) != 0:
                why = why or _reason(advice, ctypes.get_errno())
                break
        else:
            done += length
    return HugePages(done, asked, why)


def _spans(leaves: Iterable[Any]) -> Iterable[tuple[int, int]]:
    """(start, length) of the 2 MB-aligned span inside each CPU buffer of the leaves, when not empty."""
    for leaf in leaves:
        if not isinstance(leaf, jax.Array) or leaf.is_deleted():
            continue
        for shard in leaf.addressable_shards:
            if shard.device.platform != "cpu" or shard.data.nbytes < PAGE:
                continue
            pointer = shard.data.unsafe_buffer_pointer()
            start, end = -(-pointer // PAGE) * PAGE, (pointer + shard.data.nbytes) // PAGE * PAGE
            if end > start:
                yield start, end - start


def _reason(advice: int, code: int) -> str:
    name = "MADV_HUGEPAGE" if advice == MADV_HUGEPAGE else "MADV_COLLAPSE"
    try:
        with open(SETTING) as setting:
            if "[never]" in setting.read():
                return f"transparent huge pages are off on this machine ({SETTING}: never)"
    except OSError:
        pass
    if code == errno.EINVAL:
        return f"this kernel ({os.uname().release}) does not take {name}: 2 MB pages need Linux 6.1+"
    return f"{name}: {os.strerror(code)}"


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
