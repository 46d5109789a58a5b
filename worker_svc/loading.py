"""Build a model from its checkpoint: the architecture and numbers from the file's config, the
parameters from its tensors (through the model file's checkpoint-name mapping) or random (dummy).

The model is first built abstractly (shapes only, no random init: initializing 135M parameters
with jax.random took 17 s on this CPU), then every parameter is filled in, one at a time.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from worker_svc.models import ARCHITECTURES
from worker_svc.progress import bar
from worker_svc.weights import Checkpoint, CheckpointError

def model_config(checkpoint: Checkpoint, moe: str = "fused") -> tuple[type, Any, dict]:
    """(model class, its config, its checkpoint mapping) for the checkpoint's architecture. `moe`
    (config moe.strategy) is a serving choice, not a checkpoint number: it goes into the configs of
    mixture-of-experts models (those with a `moe` field) and dense models ignore it."""
    names = checkpoint.config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            model_cls, config_cls, mapping = ARCHITECTURES[name]
            try:
                cfg = config_cls.from_hf(checkpoint.config)
            except ValueError as e:  # a config the model refuses (e.g. a feature it does not implement)
                raise CheckpointError(f"{checkpoint.path}: {e}") from None
            return model_cls, (replace(cfg, moe=moe) if hasattr(cfg, "moe") else cfg), mapping
    raise CheckpointError(f"{checkpoint.path}: architecture {names} is not supported (known: {sorted(ARCHITECTURES)})")


def load_model(checkpoint: Checkpoint, dtype: str = "float32", dummy: bool = False, seed: int = 0,
               progress: bool = True, moe: str = "fused") -> nnx.Module:
    model_cls, cfg, mapping = model_config(checkpoint, moe)
    jdtype = jnp.dtype(dtype)  # one of config.DTYPES
    abstract = nnx.eval_shape(lambda: model_cls(cfg, dtype=jdtype, rngs=nnx.Rngs(0)))
    stack_layers = dict(abstract.stack_layers)  # stack name -> the checkpoint layer of each of its rows
    graph, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    for i, (path, var) in enumerate(flat, 1):
        if dummy:
            value = _dummy(path[-1], var.shape, rng)
        else:
            value = _read(checkpoint, mapping, cfg, path, var.shape, stack_layers.get(str(path[0]), ()))
        var.set_value(jnp.asarray(value, dtype=var.dtype))
        if progress:
            bar("loading weights" + (" (dummy)" if dummy else ""), i, len(flat), time.perf_counter() - started)
    return nnx.merge(graph, nnx.from_flat_state(flat))


def _read(checkpoint: Checkpoint, mapping: dict, cfg: Any, path: tuple, shape: tuple[int, ...],
          layers: tuple[int, ...]) -> np.ndarray:
    """`layers`: the checkpoint layer index of each row of the parameter's stack."""
    key = tuple(str(p) for p in path)
    if key not in mapping:
        raise CheckpointError(f"{checkpoint.path}: the model's parameter {'.'.join(key)} has no checkpoint name")
    name, transform = mapping[key]
    if "{j}" in name:  # an expert parameter: one tensor per layer and expert, stacked on [layers, experts]
        value = np.stack([np.stack([transform(checkpoint.read(name.format(i=i, j=j)), cfg) for j in range(shape[1])])
                          for i in layers])
    elif "{i}" in name:  # a decoder-layer parameter: one tensor per layer, stacked on the leading axis
        value = np.stack([transform(checkpoint.read(name.format(i=i)), cfg) for i in layers])
    else:
        value = transform(checkpoint.read(name), cfg)
    if value.shape != tuple(shape):
        raise CheckpointError(f"{checkpoint.path}: {name} gives shape {value.shape}, the model expects {tuple(shape)}")
    return value


def _dummy(leaf: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if leaf == "scale":  # norms: ones, so activations keep their size
        return np.ones(shape, np.float32)
    return rng.standard_normal(shape, dtype=np.float32) * 0.02  # Hugging Face's initializer range
