"""Logical sharding (docs/design.md, STYLE 7): model code names each parameter's axes logically (`embed`,
`heads`, `kv_heads`, `head_dim`, `mlp`, `vocab`, `norm`, `expert`, `layers`), config
`parallelism.rules` maps each name to a mesh axis (jaxstream.config.MESH_AXES) or null
(replicated), and this module, the only one that builds a mesh or a sharding, turns the two into
NamedShardings. A name the rules do not mention is replicated.

The engine places the parameters and the KV cache with these shardings, keeps every step input and
the logits and hidden states it returns replicated, and lets jit (GSPMD) place everything between:
no collective is written by hand for tensor parallelism. Expert parallelism under `moe=ep` is the
exception: layers/moe.py exchanges tokens between the experts' devices itself, where
`Layout.expert_shards` says they live.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxstream.config import MESH_AXES, ConfigError, ParallelismConfig
from worker_svc.layers.lora import adapted_paths
from worker_svc.layers.moe import ExpertShards

# The leading axes of every paged cache array, [L, P, Z]; a token's entry names its own (layers/paged.py's
# CacheSpec: "kv_heads", "head_dim" for keys and values, none for a latent shared by every head).
CACHE_AXES = ("layers", None, None)


@dataclass(frozen=True)
class Layout:
    mesh: Mesh
    rules: dict[str, str | None]  # logical name -> mesh axis or None

    def spec(self, names: Sequence[str | None]) -> PartitionSpec:
        return PartitionSpec(*(self.rules.get(n) if n else None for n in names))

    def sharding(self, names: Sequence[str | None], shape: tuple[int, ...], what: str) -> NamedSharding:
        """The sharding of an array of `shape` whose axes have logical `names`; ConfigError when a
        mesh axis is used twice or its size does not divide the axis it shards (`what`: the array,
        for the message)."""
        spec = self.spec(names)
        used = [axis for axis in spec if axis is not None]
        if len(used) != len(set(used)):
            raise ConfigError(f"parallelism.rules: {what} has axes {tuple(names)}, which map to {tuple(spec)}: "
                              "a mesh axis may shard only one of them")
        for name, axis, size in zip(names, spec, shape):
            if axis is not None and size % self.mesh.shape[axis]:
                raise ConfigError(f"parallelism.{axis}: {self.mesh.shape[axis]} does not divide model {name} {size} "
                                  f"({what}; parallelism.rules.{name} is {axis})")
        return NamedSharding(self.mesh, spec)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def expert_shards(self) -> ExpertShards:
        """Where `ep`'s experts live under these rules (layers/moe.py exchanges tokens accordingly)."""
        if self.rules.get("embed"):
            raise ConfigError(f"parallelism.rules.embed: {self.rules['embed']} splits the model dim, which moe=ep "
                              "does not support (its exchange sends whole token rows); use null")
        mlp = self.rules.get("mlp")
        return ExpertShards(self.mesh, self.rules.get("expert"), self.spec(("expert", "embed", "mlp")),
                            self.spec(("expert", "mlp", "embed")), (mlp,) if mlp else ())


def ask_for_cpu_devices(parallelism: ParallelismConfig) -> None:
    """Where JAX's only platform is the CPU it shows one device, and a mesh of several needs that many;
    XLA can split the host into more (as the tests do with --xla_force_host_platform_device_count).
    Ask for one replica's count before JAX starts its backends, so `jaxstream up parallelism=tp2`
    also runs on a laptop. Accelerators are unaffected (their devices are jax.devices() whatever the
    CPU count), and so is a process whose XLA_FLAGS already set the count, or whose backends are up."""
    needed = math.prod(getattr(parallelism, axis) for axis in MESH_AXES)
    if needed > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        try:
            jax.config.update("jax_num_cpu_devices", needed)
        except RuntimeError:  # backends already initialized: make_layout reports the count it finds
            pass


def make_layout(parallelism: ParallelismConfig, devices: Sequence[Any] | None = None) -> Layout:
    """A mesh with axes MESH_AXES of the configured sizes over `devices` (default: jax's devices,
    or when this process sees every replica's devices, replica `parallelism.replica`'s share)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = tuple(getattr(parallelism, axis) for axis in MESH_AXES)
    per_replica = math.prod(sizes)
    if len(devices) == per_replica * parallelism.data and parallelism.data > 1:
        devices = devices[parallelism.replica * per_replica:(parallelism.replica + 1) * per_replica]
    if per_replica != len(devices):
        product = " x ".join(f"{axis} {size}" for axis, size in zip(MESH_AXES, sizes))
        raise ConfigError(f"parallelism: {product} = {per_replica} devices per replica, but there are {len(devices)} "
                          f"({devices[0].platform}); the sizes' product must equal the device count")
    return Layout(Mesh(np.asarray(devices).reshape(sizes), MESH_AXES), dict(parallelism.rules))


def param_specs(params: nnx.State, layout: Layout) -> list[tuple[str, PartitionSpec]]:
    """(dotted path, PartitionSpec) of every parameter, in state order (the golden-file test's view).
    ConfigError as `Layout.sharding` raises it, or when a mesh axis of several devices splits no
    parameter at all (e.g. expert parallelism for a model without experts)."""
    specs = [(_dotted(path), layout.sharding(_names(var), var.shape, _dotted(path)).spec)
             for path, var in nnx.to_flat_state(params)]
    used = {axis for _, spec in specs for axis in spec if axis is not None}
    for axis, size in layout.mesh.shape.items():
        if size > 1 and axis not in used:
            names = sorted(name for name, target in layout.rules.items() if target == axis)
            raise ConfigError(f"parallelism.{axis}: {size} devices, but this model has no parameter split over them "
                              f"(parallelism.rules maps {names or 'nothing'} to {axis}; the model has no such axis)")
    return specs


def param_shardings(params: nnx.State, layout: Layout) -> list[NamedSharding]:
    """The sharding of every parameter, in state order, after every check of `param_specs`."""
    return [NamedSharding(layout.mesh, spec) for _, spec in param_specs(params, layout)]


def place_params(params: nnx.State, layout: Layout) -> None:
    """Move every parameter to its sharding, in place (the state's variables are the model's); a
    parameter already there (loaded into its shards) stays."""
    for (_, var), sharding in zip(nnx.to_flat_state(params), param_shardings(params, layout)):
        if getattr(var[...], "sharding", None) != sharding:
            var.set_value(jax.device_put(var[...], sharding))


def lora_shardings(model: nnx.Module, layout: Layout, inputs: dict[str, int]) -> dict[str, tuple[NamedSharding, NamedSharding]]:
    """Where each adapted projection's slot arrays live (adapters.py): A [L, S, Din, r] and B [L, S,
    r, Dout] split as the projection's base weight, `inputs` giving each one's Din (the weight's
    leading axes after the layer axis, flattened). A column-parallel projection (q, k, v, gate, up
    under tp: its output split) gets B split on Dout and A whole; a row-parallel one (o, down: its
    input split) A split on Din and B whole, so x's shard meets A's and the partial sums add up
    in one all-reduce of [T, r]. A flattened axis is split where only its outermost logical axis
    is (heads of heads x head_dim: each device's heads are a contiguous block of it); else whole."""

    def split(names: tuple[str | None, ...]) -> str | None:
        axes = [layout.rules.get(n) if n else None for n in names]
        return axes[0] if not any(axes[1:]) else None

    found = {}
    for stack, module, name in sorted(adapted_paths(model)):
        var = getattr(getattr(getattr(model, stack), module), name)
        var = getattr(var, "values", var)  # an int8 weight's values have its names (quantized.py)
        names, shape = _names(var)[1:], var.shape[1:]  # less the layer axis
        if name in found or name not in inputs:
            continue
        into = next(k for k in range(len(shape) + 1) if math.prod(shape[:k]) == inputs[name])
        a, b = split(names[:into]), split(names[into:])
        found[name] = (NamedSharding(layout.mesh, PartitionSpec(None, None, a, None)),
                       NamedSharding(layout.mesh, PartitionSpec(None, None, None, b)))
    return found


def _names(var: nnx.Variable) -> tuple[str | None, ...]:
    names = var.get_metadata().get("out_sharding") or ()
    if len(names) != len(var.shape):  # model code names every axis of every parameter
        raise ValueError(f"a parameter of shape {var.shape} has logical names {names}")
    return tuple(names)


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)
