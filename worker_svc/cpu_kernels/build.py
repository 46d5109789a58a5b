"""Building and registering jaxstream's own XLA:CPU kernels (product_kernel.py, attention_kernel.py).

A kernel is one C++ source of XLA FFI handlers, with cpu_kernel.h beside it. It compiles with the
machine's C++ compiler (`c++`, or $CXX) for its own CPU (-march=native) against jaxlib's FFI
headers, once per source, header, compiler, jaxlib and CPU (its instruction sets: a shared home
directory may serve several machines): the library is kept in DIRECTORY under a name hashing them.
Without a compiler, or if the build fails, `CpuKernel.load` says why in one line, and start-up
(worker_svc/start.py) leaves that kernel out of the model's Numerics, so XLA's way runs (a warning
in the log, not an error).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax

HEADER = Path(__file__).with_name("cpu_kernel.h")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c++17")
DIRECTORY = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "jaxstream" / "kernels"


class CpuKernel:
    """The handlers `targets` ({XLA target name: exported symbol}) of the C++ file `source`."""

    def __init__(self, source: Path, targets: dict[str, str]) -> None:
        self.source, self.targets = source, targets
        self._lock = threading.Lock()
        self._loaded: str | None = None  # None: not tried; "": loaded; else why it could not be

    def load(self) -> str:
        """Build (once per process) and register the handlers: "" when they are ready, else why not (one line)."""
        with self._lock:
            if self._loaded is None:
                try:
                    library = ctypes.cdll.LoadLibrary(str(self.build(DIRECTORY)))
                    for target, symbol in self.targets.items():
                        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
                    self._loaded = ""
                except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as exc:  # AttributeError: no symbol
                    self._loaded = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return self._loaded

    def build(self, directory: Path) -> Path:
        """The compiled library in `directory`, built unless a library of the same key is there."""
        compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
        if not compiler:
            raise RuntimeError("no C++ compiler (c++, g++, clang++ or $CXX) on PATH")
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([self.source.read_text(), HEADER.read_text(), compiler, version, *FLAGS,
                                        jax.__version__, jax.ffi.include_dir(), _cpu()]).encode()).hexdigest()[:16]
        library = directory / f"{self.source.stem}-{key}.so"
        if library.exists():
            return library
        directory.mkdir(parents=True, exist_ok=True)
        # Written under a temporary name and renamed: workers starting together each build, none reads half a file.
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            built = Path(scratch) / library.name
            done = subprocess.run([compiler, *FLAGS, "-I", jax.ffi.include_dir(), "-I", str(HEADER.parent), str(self.source),
                                   "-o", str(built)], capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines() or ["?"]
                raise RuntimeError(f"{Path(compiler).name} could not build {self.source.name}: {errors[0]}")
            os.replace(built, library)
        return library


def _cpu() -> str:
    """What -march=native compiles for: the CPU's flags line on Linux, else what platform tells."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
