"""A one-line progress bar on stderr (start-up only: weight loading and compilation)."""

from __future__ import annotations

import sys


def bar(label: str, done: int, total: int, seconds: float) -> None:
    width = 30
    filled = width * done // max(total, 1)
    end = "\n" if done == total else ""
    sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {seconds:.0f}s{end}")
    sys.stderr.flush()
