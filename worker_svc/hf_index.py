"""Hugging Face tensor names -> where each lives in the model's parameters, from the model file's
checkpoint mapping (loading.py reads through the same mapping, parameter by parameter; a trainer
pushing weights by name needs the other direction, tensor by tensor).

A name is one row of a parameter: `model.layers.3.self_attn.q_proj.weight` is row r of the stacked
`layers.attn.q` [L, D, N, H], where the model's `stack_layers` says row r holds checkpoint layer 3;
`model.layers.3.mlp.experts.5.up_proj.weight` is row (r, 5) of an [L, E, D, F] expert stack; a name
without a layer is its whole parameter. Tied embeddings: a model without an LM head reads no
`lm_head.weight`, so none is listed, though the mapping names it. An int8 weight (layers/quantized.py)
is one parameter here, at its module's path: the tensor fills its values, and its scale is derived.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from worker_svc.layers.quantized import QArray, dequantize, fills
from worker_svc.models import ARCHITECTURES, TO_HF
from worker_svc.models.llama import Transform


@dataclass(frozen=True)
class Row:
    path: tuple  # the parameter's path in the model's state, e.g. ("layers", "attn", "q")
    at: tuple[int, ...]  # () the whole parameter; (r,) row r of a layer stack; (r, j) expert j of that row
    hf_shape: tuple[int, ...]  # the tensor's shape in Hugging Face layout, e.g. [N*H, D] for q_proj
    transform: Transform  # Hugging Face layout -> ours (the model file's)


def checkpoint_mapping(model_cls: type) -> dict[tuple[str, ...], tuple[str, Transform]]:
    """The model file's mapping, found by the model's class (a test's model built without a
    checkpoint has one too)."""
    for cls, _, mapping in ARCHITECTURES.values():
        if cls is model_cls:
            return mapping
    raise ValueError(f"{model_cls.__name__} is not in worker_svc.models.ARCHITECTURES: it has no checkpoint names")


def tensor_index(model: nnx.Module) -> dict[str, Row]:
    """Every Hugging Face tensor name the model reads -> its Row, in model order: the state's
    parameter order (load_model's), then rows in order. Shapes only: nothing is allocated (the
    Hugging Face shapes come from jax.eval_shape of each transform's inverse)."""
    mapping, stack_layers = checkpoint_mapping(type(model)), dict(model.stack_layers)
    index: dict[str, Row] = {}
    for path, var, _ in fills(nnx.to_flat_state(nnx.state(model))):
        key = tuple(str(p) for p in path)
        if key not in mapping:  # a model file that forgot one: a bug, not a bad checkpoint
            raise ValueError(f"{type(model).__name__}'s parameter {'.'.join(key)} has no checkpoint name in its mapping")
        name, transform = mapping[key]
        if "{j}" in name:  # [layers, experts, ...]: one tensor per layer and expert
            rows = [(name.format(i=i, j=j), (r, j)) for r, i in enumerate(stack_layers[str(path[0])]) for j in range(var.shape[1])]
        elif "{i}" in name:  # [layers, ...]: one tensor per layer
            rows = [(name.format(i=i), (r,)) for r, i in enumerate(stack_layers[str(path[0])])]
        else:
            rows = [(name, ())]
        hf_shape = _hf_shape(transform, var.shape[len(rows[0][1]):], var.dtype, model.cfg)
        index.update((tensor, Row(path, at, hf_shape, transform)) for tensor, at in rows)
    return index


def by_param(index: dict[str, Row]) -> dict[tuple, list[tuple[str, Row]]]:
    """The index grouped by parameter: each parameter's tensors, in row order."""
    groups: dict[tuple, list[tuple[str, Row]]] = {}
    for name, row in index.items():
        groups.setdefault(row.path, []).append((name, row))
    return groups


def _hf_shape(transform: Transform, shape: tuple[int, ...], dtype: Any, cfg: Any) -> tuple[int, ...]:
    to_hf = TO_HF[transform]
    return tuple(jax.eval_shape(lambda w: to_hf(w, cfg), jax.ShapeDtypeStruct(shape, dtype)).shape)


def hf_tensors(model: nnx.Module) -> Iterator[tuple[str, np.ndarray]]:
    """The model's weights as a Hugging Face checkpoint holds them: (name, tensor in HF layout, the
    model's dtype; an int8 weight's dequantized, in float32), in model order, one at a time (tests
    write checkpoints and push weights with it)."""
    live = {path: leaves for path, _, leaves in fills(nnx.to_flat_state(nnx.state(model)))}
    host: dict[tuple, np.ndarray] = {}  # the parameter being read, alone (the index is in parameter order)
    for name, row in tensor_index(model).items():
        if row.path not in host:
            arrays = [np.asarray(var[...]) for _, var in live[row.path]]
            host = {row.path: arrays[0] if len(arrays) == 1 else np.asarray(dequantize(QArray(*arrays), np.float32))}
        # contiguous: safetensors.numpy.save_file writes a strided view's buffer as if it were not
        yield name, np.ascontiguousarray(TO_HF[row.transform](host[row.path][row.at], model.cfg))
