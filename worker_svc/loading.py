"""Build a model from its checkpoint: the architecture and numbers from the file's config, the
parameters from its tensors (through the model file's checkpoint-name mapping) or random (dummy).
A config's `model.hf_config` stands in for the file when no tensor is read (`open_model`).

The model is first built abstractly (shapes only, no random init: initializing 135M parameters
with jax.random took 17 s on this CPU), then every parameter is filled in, one at a time.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxstream.config import ConfigError, ModelConfig
from worker_svc.models import ARCHITECTURES
from worker_svc.progress import Report, reporter
from worker_svc.sharding import Layout, param_shardings
from worker_svc.weights import Checkpoint, CheckpointError, open_checkpoint
from worker_svc.weights.hf_dir import with_implicit_keys


def open_model(model: ModelConfig, dummy: bool) -> Checkpoint:
    """What the worker builds from. model.hf_config alone when it is given and no tensor is read
    (`dummy` weights, or model.path null): a checkpoint without tensors, whose errors name
    model.hf_config. Else model.path's checkpoint, whose config must agree with every key of
    model.hf_config."""
    if model.hf_config and (dummy or model.path is None):
        def no_tensors(name: str) -> np.ndarray:
            raise CheckpointError(f"model.hf_config: numbers only, no tensor {name!r} (the weights are random)")

        return Checkpoint(Path("model.hf_config"), with_implicit_keys(model.hf_config), (), no_tensors)
    checkpoint = open_checkpoint(model.path)
    check_hf_config(model.hf_config, checkpoint)
    return checkpoint


def check_hf_config(given: dict[str, Any], checkpoint: Checkpoint) -> None:
    """Each key given must equal the checkpoint's config's (a null one counts as absent, as it does
    to transformers), else a ConfigError naming model.hf_config.<key> and both values."""
    for key, ours in given.items():
        theirs = checkpoint.config.get(key)
        if not _same(ours, theirs):
            states = f"says {theirs!r}" if key in checkpoint.config else "does not state it"
            raise ConfigError(f"model.hf_config.{key}: {ours!r} here, but the config of {checkpoint.path} {states}: "
                              "the config describes another model than the file holds")


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON values: 1 and 1.0 are, true and 1 are not; a dict's null entries are absent;
    floats to float32's precision (a GGUF stores rms_norm_eps 1e-5 as 9.99999975e-06)."""
    if isinstance(a, dict) and isinstance(b, dict):
        a, b = ({k: v for k, v in d.items() if v is not None} for d in (a, b))
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-6)
    return a == b


def model_config(checkpoint: Checkpoint, moe: str = "fused", layout: Layout | None = None) -> tuple[type, Any, dict]:
    """(model class, its config, its checkpoint mapping) for the checkpoint's architecture. `moe`
    (config moe.strategy) and, for `ep`, where `layout` puts the experts are serving choices, not
    checkpoint numbers: they go into the configs of mixture-of-experts models (those with a `moe`
    field) and dense models ignore them."""
    names = checkpoint.config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            model_cls, config_cls, mapping = ARCHITECTURES[name]
            try:
                cfg = config_cls.from_hf(checkpoint.config)
            except ValueError as e:  # a config the model refuses (e.g. a feature it does not implement)
                raise CheckpointError(f"{checkpoint.path}: {e}") from None
            except KeyError as e:  # a number the model needs is missing (e.g. a partial model.hf_config)
                raise CheckpointError(f"{checkpoint.path}: the config lacks {e.args[0]!r}, which {name} needs") from None
            if hasattr(cfg, "moe"):
                shards = layout.expert_shards() if layout is not None and moe == "ep" else None
                cfg = replace(cfg, moe=moe, shards=shards)
            return model_cls, cfg, mapping
    raise CheckpointError(f"{checkpoint.path}: architecture {names} is not supported (known: {sorted(ARCHITECTURES)})")


def load_model(checkpoint: Checkpoint, dtype: str = "float32", dummy: bool = False, seed: int = 0,
               progress: bool | Report = True, moe: str = "fused", layout: Layout | None = None) -> nnx.Module:
    """With a `layout`, each parameter goes from the host straight into its shards (no device ever
    holds a whole copy it does not keep); a layout the model does not fit fails before any is read."""
    model_cls, cfg, mapping = model_config(checkpoint, moe, layout)
    jdtype = jnp.dtype(dtype)  # one of config.DTYPES
    abstract = nnx.eval_shape(lambda: model_cls(cfg, dtype=jdtype, rngs=nnx.Rngs(0)))
    stack_layers = dict(abstract.stack_layers)  # stack name -> the checkpoint layer of each of its rows
    graph, state = nnx.split(abstract)
    shardings = {} if layout is None else dict(zip((path for path, _ in nnx.to_flat_state(state)), param_shardings(state, layout)))
    flat = nnx.to_flat_state(state)
    rng = np.random.default_rng(seed)
    report = reporter(progress)
    started = time.perf_counter()
    for i, (path, var) in enumerate(flat, 1):
        if dummy:
            value = dummy_param(path[-1], var.shape, rng)
        else:
            value = read_param(checkpoint, mapping, cfg, path, var.shape, stack_layers.get(str(path[0]), ()))
        value = np.asarray(value).astype(var.dtype, copy=False)
        var.set_value(jax.device_put(value, shardings[path]) if shardings else jnp.asarray(value))
        if report:
            report("loading weights" + (" (dummy)" if dummy else ""), i, len(flat), time.perf_counter() - started)
    return nnx.merge(graph, nnx.from_flat_state(flat))


def read_param(checkpoint: Checkpoint, mapping: dict, cfg: Any, path: tuple, shape: tuple[int, ...],
               layers: tuple[int, ...]) -> np.ndarray:
    """One parameter of `shape` at `path`, as numpy in our layout and the checkpoint's dtype (the
    caller casts). `layers`: the checkpoint layer index of each row of the parameter's stack.
    Used by load_model and by a hot swap from disk (swap.py), so both read the same values."""
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


def dummy_param(leaf: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A random parameter; drawn in the model's flat-state order from one seed, the same every time."""
    if leaf == "scale":  # norms: ones, so activations keep their size
        return np.ones(shape, np.float32)
    return rng.standard_normal(shape, dtype=np.float32) * 0.02  # Hugging Face's initializer range
