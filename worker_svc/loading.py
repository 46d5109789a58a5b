"""Build a model from its checkpoint: the architecture and numbers from the file's config, the
parameters from its tensors (through the model file's checkpoint-name mapping) or random (dummy).
A config's `model.hf_config` stands in for the file when no tensor is read (`open_model`).

The model is first built abstractly (shapes only, no random init: initializing 135M parameters
with jax.random took 17 s on this CPU), then every parameter is filled in, one at a time. Under
worker.quantization=int8 a weight is quantized on the host as it is filled, from whatever the
checkpoint holds (a GGUF's own quantized blocks are dequantized by its reader first: their
per-block scales are not per output channel), into its two leaves (layers/quantized.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxstream.config import ConfigError, ModelConfig
from worker_svc.hf_index import by_param, tensor_index
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.quantized import fills, leaf_values
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


def model_config(checkpoint: Checkpoint, moe: str = "fused", layout: Layout | None = None,
                 numerics: Numerics = Numerics()) -> tuple[type, Any, dict]:
    """(model class, its config, its checkpoint mapping) for the checkpoint's architecture. `moe`
    (config moe.strategy) and, for `ep`, where `layout` puts the experts are serving choices, not
    checkpoint numbers: they go into the configs of mixture-of-experts models (those with a `moe`
    field) and dense models ignore them. So does `numerics` (worker.batch_invariant, router_fp32,
    lm_head_fp32, quantization), into every model's."""
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
            return model_cls, replace(cfg, numerics=numerics), mapping
    raise CheckpointError(f"{checkpoint.path}: architecture {names} is not supported (known: {sorted(ARCHITECTURES)})")


def load_model(checkpoint: Checkpoint, dtype: str = "float32", dummy: bool = False, seed: int = 0,
               progress: bool | Report = True, moe: str = "fused", layout: Layout | None = None,
               numerics: Numerics = Numerics()) -> nnx.Module:
    """With a `layout`, each parameter goes from the host straight into its shards (no device ever
    holds a whole copy it does not keep); a layout the model does not fit fails before any is read."""
    model_cls, cfg, _ = model_config(checkpoint, moe, layout, numerics)
    jdtype = jnp.dtype(dtype)  # one of config.DTYPES
    abstract = nnx.eval_shape(lambda: model_cls(cfg, dtype=jdtype, rngs=nnx.Rngs(0)))
    graph, state = nnx.split(abstract)
    shardings = {} if layout is None else dict(zip((path for path, _ in nnx.to_flat_state(state)), param_shardings(state, layout)))
    flat = nnx.to_flat_state(state)
    params = list(fills(flat))  # a checkpoint's parameters, each filling one leaf, or an int8 weight's two
    shapes = [(path, var) for path, var, _ in params]
    values = dummy_params(shapes, seed) if dummy else checkpoint_params(checkpoint, abstract, shapes)
    report = reporter(progress)
    started = time.perf_counter()
    for i, ((_, _, leaves), value) in enumerate(zip(params, values), 1):
        for (path, var), leaf in zip(leaves, leaf_values(value, leaves)):
            leaf = np.asarray(leaf).astype(var.dtype, copy=False)
            var.set_value(jax.device_put(leaf, shardings[path]) if shardings else jnp.asarray(leaf))
        if report:
            report("loading weights" + (" (dummy)" if dummy else ""), i, len(params), time.perf_counter() - started)
    return nnx.merge(graph, nnx.from_flat_state(flat))


def checkpoint_params(checkpoint: Checkpoint, model: nnx.Module, flat: Iterable[tuple[tuple, Any]]) -> Iterator[np.ndarray]:
    """Each parameter of `flat` ((path, a stand-in with its shape) of each of `model`'s parameters,
    as quantized.fills gives them; abstract or live: only shapes are read) in turn, read from the
    checkpoint tensor by tensor through the model file's mapping (hf_index.py, which a push by name
    uses too), in our layout and the checkpoint's dtype (the caller casts or quantizes). One host
    copy at a time: load_model's and a hot swap's (swap.py) alike."""
    tensors = by_param(tensor_index(model))
    for path, var in flat:
        value = None
        for name, row in tensors[path]:
            part = row.transform(checkpoint.read(name), model.cfg)
            want = tuple(var.shape[len(row.at):])
            if part.shape != want:
                raise CheckpointError(f"{checkpoint.path}: {name} gives shape {part.shape} in our layout, the model expects {want}")
            if value is None:
                value = np.empty(var.shape, part.dtype)
            value[row.at] = part
        yield value


def dummy_params(flat: Iterable[tuple[tuple, Any]], seed: int) -> Iterator[np.ndarray]:
    """Random parameters for `flat` (as checkpoint_params takes it), drawn in its order from one seed:
    the same values every time (load_model's dummy weights, and their reload after a memory
    release), int8 or not (an int8 weight quantizes the same draw)."""
    rng = np.random.default_rng(seed)
    for path, var in flat:
        yield dummy_param(path[-1], var.shape, rng)


def dummy_param(leaf: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if leaf == "scale":  # norms: ones, so activations keep their size
        return np.ones(shape, np.float32)
    return rng.standard_normal(shape, dtype=np.float32) * 0.02  # Hugging Face's initializer range
