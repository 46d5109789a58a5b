"""The platform JAX will run the worker on, as far as it can be told without importing JAX (the
scheduler, gateway and preflight never import it, and size the KV pool from worker.dtype as the
worker does): JAX_PLATFORMS where it is set, else a GPU or TPU where JAX's plugin for one is
installed (pip's jax[cuda12], jax[cuda13], jax[rocm], jax[tpu]), else the CPU.

A plugin installed on a machine without its device makes JAX fall back to the CPU, which this
cannot see: there, and where services run on different machines, set worker.dtype explicitly.
"""

from __future__ import annotations

import importlib.util
import os

# JAX's PJRT plugin modules, by the platform each brings (JAX's `jax_plugins` packages, and libtpu)
PLUGINS = (("jax_cuda13_plugin", "gpu"), ("jax_cuda12_plugin", "gpu"), ("jax_rocm7_plugin", "gpu"), ("jax_rocm60_plugin", "gpu"),
           ("libtpu", "tpu"))
GPU_NAMES = ("cuda", "rocm", "gpu")


def expected_platform() -> str:
    """"cpu", "gpu" or "tpu": JAX_PLATFORMS' first (cuda and rocm are gpu), else an installed
    plugin's, else "cpu"."""
    named = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if named:
        first = named.split(",")[0].strip()
        return "gpu" if first in GPU_NAMES else first
    for module, platform in PLUGINS:
        if importlib.util.find_spec(module) is not None:
            return platform
    return "cpu"


def auto_dtype() -> str:
    """worker.dtype=auto's choice: bfloat16 on a GPU or TPU (their matrix units' type, half the
    bytes each decode step reads), float32 on a CPU (where bfloat16 is slower: docs/performance.md)."""
    return "float32" if expected_platform() == "cpu" else "bfloat16"
