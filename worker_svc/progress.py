"""Progress on stderr for start-up work (weight loading, compilation): a bar redrawn in place on a
terminal; under `jaxstream up`, whose children write to a pipe, a line at every tenth instead, so
the prefixed log stays readable. A caller may pass its own report instead (the worker's also tells
the gateway, through its Bus, what it is doing)."""

from __future__ import annotations

import sys
from collections.abc import Callable

Report = Callable[[str, int, int, float], None]  # (label, done, total, seconds so far)


def reporter(progress: bool | Report) -> Report | None:
    """What to call per item: the caller's report, `bar` for True, nothing for False."""
    if callable(progress):
        return progress
    return bar if progress else None


def bar(label: str, done: int, total: int, seconds: float) -> None:
    total = max(total, 1)
    if sys.stderr.isatty():
        width = 30
        filled = width * done // total
        end = "\n" if done == total else ""
        sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {seconds:.0f}s{end}")
    elif done == total or 10 * done // total != 10 * (done - 1) // total:
        sys.stderr.write(f"{label}: {done}/{total} ({100 * done // total}%) {seconds:.0f}s\n")
    sys.stderr.flush()
