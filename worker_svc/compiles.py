"""Counts XLA compilations in this process, from JAX's own monitoring events: a compile, or an
executable loaded from the on-disk compilation cache. After start-up the count must stay put."""

from __future__ import annotations

import threading

import jax

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _on_duration(self, event: str, duration: float, **_: object) -> None:
        if event == _BACKEND_COMPILE:
            self._bump()

    def _on_event(self, event: str, **_: object) -> None:
        if event == _CACHE_HIT:
            self._bump()

    def _bump(self) -> None:
        with self._lock:
            self.count += 1


_counter: CompileCounter | None = None


def counter() -> CompileCounter:
    """The process's one counter (JAX listeners cannot be removed, so register them once)."""
    global _counter
    if _counter is None:
        _counter = CompileCounter()
    return _counter
