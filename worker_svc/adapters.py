"""LoRA adapters on the host and in their device slots (the layers' side: layers/lora.py).

1. `read_peft` reads a PEFT directory (adapter_config.json + adapter_model.safetensors, through
   jaxstream/safetensors.py: no pickle, no .bin): its rank, lora_alpha, use_rslora, target modules and
   base model, and its tensors by PEFT's names (`base_model.model.` + the checkpoint name of the
   adapted weight, `.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]), found through the model
   file's own checkpoint mapping (hf_index.py): a name the model does not read is refused by name.
2. `AdapterSlots` holds the slot arrays on the device: for each targeted projection A [L, S, Din, r]
   and B [L, S, r, Dout] (r = max_rank, zero past an adapter's rank), a scale [S]; `load` writes an
   adapter into a slot (every row of it: what an earlier one left is zeroed), between steps, in
   place (the arrays keep their shapes: no step recompiles); `step` hands a step's layers the arrays
   and each token's slot (LoraStep). An unloaded adapter's slot is not cleared: no request names it
   until a load writes it whole.

Layouts: our projections' outputs (and o's input) flatten to Hugging Face's row order (q [N, H] is
q_proj's N*H rows, head by head: the model files' transforms reshape without permuting), so A is
lora_A transposed, [in, r], and B is lora_B transposed, [r, out], for every model file read so far.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxstream import safetensors
from worker_svc.hf_index import tensor_index
from worker_svc.layers.lora import LoraStep, adapted_paths

PEFT_NAMES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
PREFIX = "base_model.model."
# What each projection's input and output size is of the model's config (Hugging Face's names): how a
# mismatch is named, an adapter made for another model
SIZES = {"q": ("hidden_size", "num_attention_heads x head_dim"), "k": ("hidden_size", "num_key_value_heads x head_dim"),
         "v": ("hidden_size", "num_key_value_heads x head_dim"), "o": ("num_attention_heads x head_dim", "hidden_size"),
         "gate": ("hidden_size", "intermediate_size"), "up": ("hidden_size", "intermediate_size"),
         "down": ("intermediate_size", "hidden_size")}


@dataclass(frozen=True)
class Adapter:
    """A PEFT adapter in our layouts: (target, layer) -> (A [Din, rank], B [rank, Dout]) float32."""

    rank: int
    scale: float  # alpha / rank, or alpha / sqrt(rank) (rsLoRA)
    targets: tuple[str, ...]  # our names
    base: str | None  # base_model_name_or_path
    tensors: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]


Projections = dict[str, tuple[int, int, dict[int, str]]]  # our name -> (Din, Dout, {layer: its checkpoint name})


def projections(model: nnx.Module) -> Projections:
    """The model's projections that take adapters (layers/lora.py's `adapted_paths`), found in its
    checkpoint names (hf_index.py). Experts (a row per expert) are never among them."""
    index, paths = tensor_index(model), adapted_paths(model)
    found: Projections = {}
    for name, row in index.items():
        target = row.path[-1] if row.path else None
        if tuple(map(str, row.path)) in paths and len(row.at) == 1 and name.endswith(".weight"):
            layer = int(name.split(".layers.")[1].split(".")[0])
            out, into = row.hf_shape[0], int(np.prod(row.hf_shape[1:]))
            found.setdefault(target, (into, out, {}))[2][layer] = name.removesuffix(".weight")
    return found


def read_peft(path: str | Path, found: Projections, max_rank: int, targets: tuple[str, ...], layers: int | None = None) -> Adapter:
    """The PEFT directory `path`, for the model of `found` (`projections`; `layers` layers, None: not
    checked) and slots of rank `max_rank` on `targets` (our names). ValueError naming what does not fit:
    a rank above max_rank, a module not targeted (or not in the model: an expert), an adapter made for
    another model (`check_base`), a tensor of the wrong shape or missing, a setting not served."""
    path = Path(path)
    config_file, tensors_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not tensors_file.is_file():
        raise ValueError(f"{path}: no adapter_model.safetensors (a .bin adapter is not read: it is a pickle)")
    if not config_file.is_file():
        raise ValueError(f"{path}: no adapter_config.json")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as e:
        raise ValueError(f"{config_file}: not a PEFT LoRA config ({type(e).__name__}: {e})") from None
    return peft_adapter(config, dict(safetensors.decode(tensors_file.read_bytes())), found, max_rank, targets, str(path), layers)


def peft_adapter(config: dict, stored: dict[str, np.ndarray], found: Projections, max_rank: int, targets: tuple[str, ...],
                 where: str, layers: int | None = None) -> Adapter:
    """An adapter from PEFT's LoRA config (adapter_config.json's fields) and its tensors by PEFT's
    names (a directory's, or pushed: /load_lora_adapter_from_tensors), for a model of `layers` layers
    (None: not checked); `where` names it in errors."""
    try:
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", 8))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{where}: not a PEFT LoRA config ({type(e).__name__}: {e})") from None
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} is above worker.lora.max_rank {max_rank}")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"{where}: {key} {config[key]} is not served (one rank and alpha for every module)")
    if config.get("use_dora"):
        raise ValueError(f"{where}: use_dora is not served")
    modules = config.get("target_modules") or []
    if isinstance(modules, str):
        raise ValueError(f"{where}: target_modules {modules!r} is a pattern; name the modules ({sorted(PEFT_NAMES)})")
    ours = []
    for module in sorted(modules):  # PEFT writes a set: in name order, the same error every time
        name = PEFT_NAMES.get(module)
        if name not in found:
            adaptable = sorted(peft for peft, ours in PEFT_NAMES.items() if ours in found)
            raise ValueError(f"{where}: target module {module!r} is not adaptable in this model (only {adaptable}; experts never)")
        if name not in targets:
            raise ValueError(f"{where}: target module {module!r} is not in worker.lora.target_modules {list(targets)}")
        ours.append(name)
    check_base(stored, found, tuple(ours), rank, layers, where)
    tensors = {}
    for name in ours:
        names = found[name][2]
        for layer, base in names.items():
            a, b = (_tensor(stored, f"{PREFIX}{base}.lora_{x}.weight", where) for x in "AB")
            tensors[(name, layer)] = (a.T, b.T)
    known = {f"{PREFIX}{base}.lora_{x}.weight" for name in ours for base in found[name][2].values() for x in "AB"}
    extra = sorted(set(stored) - known)
    if extra:
        raise ValueError(f"{where}: tensor {extra[0]!r} is not one of the targeted modules' ({len(extra)} such)")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return Adapter(rank, scale, tuple(ours), config.get("base_model_name_or_path"), tensors)


def check_base(stored: dict[str, np.ndarray], found: Projections, targets: tuple[str, ...], rank: int, layers: int | None,
               where: str) -> None:
    """ValueError naming the tensor whose shape is not the one this model and `rank` expect (the one
    shape check), and the size that differs where the tensors `stored` (PEFT's names) of `targets` were
    made for a model other than that of `found` with `layers` layers: a projection's input or output
    size (hidden_size, intermediate_size, heads x head_dim), then the layer count, before any tensor is
    taken. `where` opens the message (the adapter)."""
    for t in targets:
        into, out, names = found[t]
        for layer, base in sorted(names.items()):
            for x, expected in (("A", (rank, into)), ("B", (out, rank))):
                name = f"{PREFIX}{base}.lora_{x}.weight"
                theirs = stored.get(name)
                if theirs is None or theirs.shape == expected:
                    continue
                axis = 1 if x == "A" else 0
                made = (f": the adapter was made for a model with {SIZES[t][1 - axis]} {theirs.shape[axis]}, this model has "
                        f"{expected[axis]}") if theirs.ndim == 2 and theirs.shape[axis] != expected[axis] else ""
                raise ValueError(f"{where}: tensor {name!r} has shape {theirs.shape}, the model expects {expected}{made}")
    at = {int(m.group(1)) for name in stored if (m := re.search(r"\.layers\.(\d+)\.", name))}
    ours = max((layer for t in targets for layer in found[t][2]), default=-1)
    if at and (layers is not None and max(at) >= layers or max(at) < ours):
        raise ValueError(f"{where}: the adapter was made for a model with {max(at) + 1} layers (num_hidden_layers), this model "
                         f"has {layers if layers is not None else ours + 1}")


def _tensor(stored: dict[str, np.ndarray], name: str, where: str) -> np.ndarray:
    """A tensor `check_base` found of the right shape where present."""
    if name not in stored:
        raise ValueError(f"{where}: tensor {name!r} is missing")
    return stored[name].astype(np.float32)


class AdapterSlots:
    """`slots` adapter slots of rank up to `max_rank` on those of `targets` the model has, for the model of `found`
    (`projections`) with `layers` layers, in `dtype`, placed by `sharding` (under a mesh the layout's
    replicated one; None: the default device) but where `split` (sharding.py's `lora_shardings`:
    target -> A's and B's) splits a projection's arrays as its base weight is split."""

    def __init__(self, found: Projections, layers: int, slots: int, max_rank: int, targets: tuple[str, ...], dtype,
                 sharding: jax.sharding.Sharding | None = None,
                 split: dict[str, tuple[jax.sharding.Sharding, jax.sharding.Sharding]] | None = None) -> None:
        targets = tuple(t for t in targets if t in found)  # a mixture of experts' MLP has none: its adapters are refused by name
        self.found, self.layers, self.max_rank, self.targets, self.slots = found, layers, max_rank, tuple(targets), slots
        self.a = {t: jnp.zeros((layers, slots, found[t][0], max_rank), dtype) for t in targets}  # [L, S, Din, r]
        self.b = {t: jnp.zeros((layers, slots, max_rank, found[t][1]), dtype) for t in targets}  # [L, S, r, Dout]
        self.scale = jnp.zeros((slots,), jnp.float32)  # [S]: 0 for an empty slot
        self.sharding = sharding
        if sharding is not None:  # where the steps read them (lowered with these shardings: executables.py): no copy per step
            split = split or {}
            self.a = {t: jax.device_put(a, split[t][0] if t in split else sharding) for t, a in self.a.items()}
            self.b = {t: jax.device_put(b, split[t][1] if t in split else sharding) for t, b in self.b.items()}
            self.scale = jax.device_put(self.scale, sharding)
        self.loaded: dict[int, Adapter] = {}

    def load(self, slot: int, adapter: Adapter | str | Path) -> Adapter:
        """Write `adapter` (or the PEFT directory at that path) into `slot`, replacing what it held."""
        self._check(slot)
        if not isinstance(adapter, Adapter):
            adapter = read_peft(adapter, self.found, self.max_rank, self.targets, self.layers)
        for t in self.targets:
            a, b = np.zeros(self.a[t].shape[:1] + self.a[t].shape[2:], np.float32), np.zeros(self.b[t].shape[:1] + self.b[t].shape[2:], np.float32)
            for (name, layer), (la, lb) in adapter.tensors.items():
                if name == t:
                    a[layer, :, : adapter.rank], b[layer, : adapter.rank] = la, lb
            self.a[t], self.b[t] = _write(self.a[t], a, slot), _write(self.b[t], b, slot)
        self.scale = self.scale.at[slot].set(adapter.scale)
        self.loaded[slot] = adapter
        return adapter

    def warm(self) -> None:
        """Compile what a load runs (each slot array's write, the scale's), by writing an empty adapter
        into slot 0 as a load does: the worker does it before it counts compiles, so loading at run
        time compiles nothing. Slot 0 is left empty (scale 0: its tokens add nothing)."""
        self.load(0, Adapter(0, 0.0, (), None, {}))
        self.loaded.pop(0)

    def step(self, slot: np.ndarray) -> LoraStep:
        """The step's LoraStep, each token's slot `slot` [T] (-1: the base model)."""
        return LoraStep(dict(self.a), dict(self.b), self.scale, slot)

    def shapes(self, tokens: int) -> LoraStep:
        """A step of `tokens` tokens' LoraStep as shapes, each array's with its sharding under a mesh
        (the slot's replicated, as every step input's): what the steps are lowered with."""

        def shape(x: jax.Array | jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
            on = None if self.sharding is None else getattr(x, "sharding", self.sharding)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on)

        return jax.tree.map(shape, self.step(jax.ShapeDtypeStruct((tokens,), jnp.int32)))

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"adapter slot {slot} is not in [0, worker.lora.max_adapters {self.slots})")


def _write(stack: jax.Array, value, slot) -> jax.Array:
    """stack [L, S, ...] with slot `slot` set to value [L, ...], kept where the stack lives (split or not).
    Put only where it moved: a put commits the array, and `_set` of a committed stack is another
    compile than of the uncommitted one `warm` wrote (a load at run time would compile)."""
    out = _set(stack, value, slot)
    return out if out.sharding == stack.sharding else jax.device_put(out, stack.sharding)


@jax.jit
def _set(stack: jax.Array, value, slot) -> jax.Array:
    """(traced slot: one compile per shape, whichever slot)"""
    return stack.at[:, slot].set(jnp.asarray(value, stack.dtype))
