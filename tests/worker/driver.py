"""The in-process scheduler + engine loop the worker and model tests use; it lives in the package
(`stack.driver`), where `jaxstream bench --in-process` drives the engine with it too."""

from stack.driver import Driver, Trace, wire

__all__ = ["Driver", "Trace", "wire"]
