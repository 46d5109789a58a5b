"""worker.dtype=auto (jaxstream/accelerator.py): bfloat16 where JAX will find a GPU or TPU, float32 on
a CPU, resolved as the config loads, so every service (none imports JAX) sizes the cache alike."""

import importlib.util

import pytest

from jaxstream import accelerator
from jaxstream.config import load_config


@pytest.mark.parametrize("named, platform, dtype", [("cpu", "cpu", "float32"), ("cuda", "gpu", "bfloat16"),
                                                    ("rocm,cpu", "gpu", "bfloat16"), ("tpu", "tpu", "bfloat16")])
def test_jax_platforms_decides_first(monkeypatch, named, platform, dtype):
    monkeypatch.setenv("JAX_PLATFORMS", named)
    assert accelerator.expected_platform() == platform
    assert load_config([]).worker.dtype == dtype
    assert load_config(["worker.dtype=float32"]).worker.dtype == "float32"  # a named dtype stays


def test_an_installed_plugin_decides_without_jax_platforms(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "jax_cuda12_plugin" else None)
    assert accelerator.expected_platform() == "gpu" and load_config([]).worker.dtype == "bfloat16"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert accelerator.expected_platform() == "cpu" and load_config([]).worker.dtype == "float32"
