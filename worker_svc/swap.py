"""Hot weight updates without recompiling (docs/design.md, RL surface): new weights are staged beside
the live ones, then swapped in whole, between steps.

1. Stage. `stage_disk` reads a checkpoint of the serving model (its config must give the same
   model class and config) one parameter at a time, straight into new device buffers.
   `stage_tensors` takes tensors by Hugging Face name (hf_index.py), in as many buckets as a
   trainer sends; each bucket copies to the host only the parameters it touches, writes its rows
   there, and puts them back on the device as staged buffers. A parameter nobody stages keeps its
   live value. Under int8 (layers/quantized.py) a parameter is its two leaves, values and scale,
   quantized from the float tensor on the host: a push of one row of a stacked weight quantizes
   that row alone (its scales are the row's own: per layer, expert and output channel), so the
   other rows keep their bytes.
2. Commit. Each staged leaf replaces its live one in a new State: the same tree, and each staged
   buffer has its live leaf's shape, dtype and sharding (put with it, cast to it), so the State is
   the one every executable was compiled for and nothing compiles.
3. Any error discards the whole staging: an update lands whole or not at all, and the live weights
   serve meanwhile.

Memory: until commit the device holds each staged parameter beside its live one; the commit drops
the live ones (nothing else holds them). The host holds one stacked parameter at a time from disk,
or one bucket's parameters. No jax.numpy here: an eager operation compiles, and the compile count
after start-up must stay 0.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import fields

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from worker_svc.hf_index import Row, tensor_index
from worker_svc.layers.quantized import fills, leaf_values
from worker_svc.loading import checkpoint_params, dummy_params, model_config
from worker_svc.sharding import Layout
from worker_svc.weights import Checkpoint, CheckpointError, open_checkpoint


class WeightSwap:
    """The staged leaves of one weight update, by parameter path, until commit or discard. Each
    method takes the live model (`nnx.merge` of the engine's graph and params: its class, config,
    stacks and leaves), so nothing here holds a live weight."""

    def __init__(self, layout: Layout | None) -> None:
        self.layout = layout  # the serving one: moe=ep's expert shards are part of a model's config
        self.staged: dict[tuple, jax.Array] = {}
        self._index: dict[str, Row] | None = None  # of the serving model, whose shapes never change

    def stage_disk(self, live: nnx.Module, path: str, load_format: str | None = None) -> int:
        """Stage every parameter from the checkpoint at `path` (open_checkpoint's paths and
        load_format); returns the number of parameters staged."""
        with self._whole_or_nothing():
            checkpoint = open_checkpoint(path, load_format, key="model_path")
            model_cls, cfg, _ = model_config(checkpoint, getattr(live.cfg, "moe", "fused"), self.layout, live.cfg.numerics)
            _check_same_model(checkpoint, model_cls, cfg, live)
            return self._stage_all(live, lambda leaves: checkpoint_params(checkpoint, live, leaves))

    def stage_dummy(self, live: nnx.Module, seed: int) -> int:
        """Stage the random weights `load_model(dummy=True, seed=seed)` gives: the same values, drawn
        in the same order (a resume of dummy weights after a release)."""
        with self._whole_or_nothing():
            return self._stage_all(live, lambda leaves: dummy_params(leaves, seed))

    def _stage_all(self, live: nnx.Module, values) -> int:
        """Stage every parameter, from `values(params)`: one host array each, in the parameters'
        order ((path, a stand-in with its shape) each, as loading.checkpoint_params takes them)."""
        params = list(fills(nnx.to_flat_state(nnx.state(live))))
        for (_, _, leaves), value in zip(params, values([(path, var) for path, var, _ in params])):
            for (key, var), leaf in zip(leaves, leaf_values(value, leaves)):
                self.staged[key] = _put_like(leaf, var[...])  # the host copy goes with this iteration
        return len(params)

    def stage_tensors(self, live: nnx.Module, tensors: Iterable[tuple[str, np.ndarray]]) -> int:
        """Stage (Hugging Face name, tensor in HF layout, any float dtype) pairs, each a whole
        parameter or one row of a stacked one; a name given twice keeps the last. Returns the
        number of tensors taken."""
        with self._whole_or_nothing():
            index = self.index(live)
            flat = nnx.to_flat_state(nnx.state(live))
            params = {path: param_leaves for path, _, param_leaves in fills(flat)}
            leaves = dict(flat)
            host: dict[tuple, np.ndarray] = {}  # writable copies of the leaves this bucket touches
            count = 0
            for name, value in tensors:
                row = _row(index, name)
                value = row.transform(_checked(name, np.asarray(value), row), live.cfg)
                for (key, var), part in zip(params[row.path], leaf_values(value, params[row.path], row.at)):
                    if key not in host:  # from what is staged so far, else from the live leaf
                        host[key] = _host_copy(self.staged.get(key, var[...]))
                    host[key][row.at] = np.asarray(part).astype(host[key].dtype, copy=False)
                count += 1
            for key, value in host.items():
                self.staged[key] = _put_like(value, leaves[key][...])
            return count

    def commit(self, params: nnx.State) -> tuple[nnx.State, int]:
        """(the live `params` with every staged leaf in place of its own, the number of parameters
        swapped: an int8 weight's two leaves count once); the staging is then empty. CheckpointError
        when nothing is staged."""
        if not self.staged:
            raise CheckpointError("no weights are staged: stage some (from disk or by tensor) before committing")
        flat = nnx.to_flat_state(params)
        count = sum(any(key in self.staged for key, _ in leaves) for _, _, leaves in fills(flat))
        leaves = [(key, var.replace(self.staged[key]) if key in self.staged else var) for key, var in flat]
        self.staged = {}
        return nnx.from_flat_state(leaves), count

    def discard(self) -> None:
        self.staged = {}

    def names(self, live: nnx.Module) -> list[tuple[str, tuple[int, ...], str]]:
        """(Hugging Face name, its shape in HF layout, the serving dtype's name: "int8" for an int8
        weight, whose float32 scales are not listed) of every tensor the model reads, in model order
        (hf_index.py)."""
        held = {path: var for path, var, _ in fills(nnx.to_flat_state(nnx.state(live)))}
        return [(name, row.hf_shape, jnp.dtype(held[row.path].dtype).name) for name, row in self.index(live).items()]

    def index(self, live: nnx.Module) -> dict[str, Row]:
        if self._index is None:
            self._index = tensor_index(live)
        return self._index

    @contextmanager
    def _whole_or_nothing(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self.discard()
            raise


def _host_copy(array: jax.Array) -> np.ndarray:
    """A writable host copy of a leaf; zeros for a released one (its values are awaited: the
    update that stages rows of it must bring them all, worker_svc/control.py)."""
    return np.zeros(array.shape, array.dtype) if array.is_deleted() else np.array(array)


def _put_like(value: np.ndarray, live: jax.Array) -> jax.Array:
    """Host `value` as a new device array shaped as the live leaf `live`: its dtype (cast as loading
    casts) and sharding."""
    return jax.device_put(np.asarray(value).astype(live.dtype, copy=False), live.sharding)


def _check_same_model(checkpoint: Checkpoint, model_cls: type, cfg: object, live: nnx.Module) -> None:
    """The checkpoint's model must be the serving one (the dtype aside: values are cast to the live
    leaves'), else a CheckpointError saying what differs."""
    if model_cls is not type(live):
        raise CheckpointError(f"{checkpoint.path}: holds a {model_cls.__name__} model; the serving one is a {type(live).__name__}")
    if cfg != live.cfg:
        differ = [f"{f.name} {getattr(cfg, f.name)!r} (serving {getattr(live.cfg, f.name)!r})"
                  for f in fields(cfg) if getattr(cfg, f.name) != getattr(live.cfg, f.name)]
        raise CheckpointError(f"{checkpoint.path}: not the serving model's config: {', '.join(differ)}")


def _row(index: dict[str, Row], name: str) -> Row:
    if name not in index:
        near = difflib.get_close_matches(name, index, n=3)
        raise CheckpointError(f"no tensor {name!r} in the serving model" + (f"; close names: {near}" if near else ""))
    return index[name]


def _checked(name: str, value: np.ndarray, row: Row) -> np.ndarray:
    if not jnp.issubdtype(value.dtype, jnp.floating):  # jax's test: numpy does not count ml_dtypes' bfloat16 as floating
        raise CheckpointError(f"{name}: dtype {value.dtype} is not a float (float32, float16 or bfloat16)")
    if value.shape != row.hf_shape:
        raise CheckpointError(f"{name}: shape {value.shape}, but the model expects {row.hf_shape} (Hugging Face layout)")
    return value
