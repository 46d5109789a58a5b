"""Config errors that only the model's files can show, found before any service starts.

`load_config` refuses what the config alone contradicts. Some errors need the model as well: a
`model.path` that does not exist, an architecture the worker does not serve (or a sliding window it
would not honour), a tensor degree that does not divide the model's heads. The worker
used to meet them while loading, after Redis and every other service had started; now `jaxstream up`
(stack/launcher.py) and every service started alone (jaxstream/service.py) run `preflight(cfg)`
right after composing the config, so they fail as any other config error does: one line naming the
key, exit 2, nothing started.

Cheap: the model's numbers come from `model.hf_config` where the worker builds from it, else from
the checkpoint's own config (a directory's config.json, a GGUF's header: no tokenizer, no tensor
data), read at most once and only when a check needs them. The one thing it fills in rather than
checks, the page pool that scheduler.kv_cache_memory_gib holds, needs those numbers too
(jaxstream/kv_memory.py). Certain: each check refuses only what the
worker would refuse too (worker_svc/sharding.py, worker_svc/start.py), with the same message.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from jaxstream.architectures import SERVED, hybrid
from jaxstream.config import MESH_AXES, AppConfig, ConfigError, ParallelismConfig
from jaxstream.kv_memory import page_pool
from jaxstream.model_files import model_file, stated_config, tokenizer_file

# Logical axis names (parallelism.rules) that no parameter of a dense model carries: a mesh axis of
# several devices that only they map to splits nothing, which the worker refuses.
NOT_A_PARAMETER_AXIS = ("batch",)
# The model's number behind each logical axis name it is certain to shard (config.json's names).
DIVIDED = {"heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "vocab": "vocab_size",
           "expert": "num_experts"}


def preflight(cfg: AppConfig) -> None:
    """Raise a ConfigError naming the key for the first error the model's files show in `cfg`; and
    size the KV page pool where scheduler.kv_cache_memory_gib asks (its num_pages, null until then,
    set in place: every process runs this, and sizes the same pool from the same numbers)."""
    tokenizer_file(cfg.model)  # every stack reads a tokenizer: model.tokenizer's, else model.path's
    if cfg.model.path is not None:
        model_file(cfg.model.path)  # exists, and is a GGUF file or a directory
    numbers = functools.cache(lambda: model_numbers(cfg))
    cfg.scheduler.num_pages = page_pool(cfg, numbers)
    if cfg.worker.kind != "jax":
        return  # the fake worker reads no weights and lays out no mesh
    if from_hf_config(cfg) or model_file(cfg.model.path).is_dir():  # a GGUF's reader names the architectures it reads
        check_architecture(numbers)
    check_layout(cfg.parallelism, numbers)
    check_pair_buckets(cfg, numbers)
    check_hybrid(cfg, numbers)


def model_numbers(cfg: AppConfig) -> tuple[str, dict[str, Any]]:
    """(where they come from, the model's numbers by config.json's names) as the worker sees them
    (worker_svc/loading.py `open_model`): `model.hf_config` when no tensor is read, else the file's."""
    model = cfg.model
    if from_hf_config(cfg):
        source, numbers = "model.hf_config", dict(model.hf_config)
    else:
        path = model_file(model.path)
        source, numbers = str(path), stated_config(path)
    # The names transformers fills in where a config.json leaves them out (worker_svc/weights/hf_dir.py).
    if "num_attention_heads" in numbers:
        numbers.setdefault("num_key_value_heads", numbers["num_attention_heads"])
    numbers.setdefault("num_experts", numbers.get("num_local_experts") or numbers.get("n_routed_experts") or 0)  # Mixtral's, DeepSeek's
    return source, numbers


def from_hf_config(cfg: AppConfig) -> bool:
    """Whether the worker builds from `model.hf_config` alone (no tensor read), not from model.path's file."""
    return bool(cfg.model.hf_config) and (cfg.worker.weights == "dummy" or cfg.model.path is None)


def check_architecture(numbers: Callable[[], tuple[str, dict[str, Any]]]) -> None:
    """The config names an architecture the worker serves (worker_svc/models)."""
    source, model = numbers()
    key = "model.hf_config.architectures" if source == "model.hf_config" else "model.path"
    names = model.get("architectures") or []
    served = [name for name in names if name in SERVED]
    if not served:
        named = f"architecture {names} of {source} is not served" if names else f"{source} names no architecture"
        raise ConfigError(f"{key}: {named} (served: {', '.join(SERVED)})")


def check_layout(parallelism: ParallelismConfig, numbers: Callable[[], tuple[str, dict[str, Any]]]) -> None:
    """Every mesh axis of several devices splits some parameter, and divides each model number it
    splits: attention heads, KV heads, the vocabulary, the experts."""
    sizes = {axis: getattr(parallelism, axis) for axis in MESH_AXES}
    if all(size == 1 for size in sizes.values()):
        return
    source, model = numbers()
    for name, number in DIVIDED.items():
        axis, value = parallelism.rules.get(name), model.get(number)
        if number == "num_experts":  # named as the config states it: Mixtral's, DeepSeek's, or num_experts
            number = next(key for key in ("num_local_experts", "n_routed_experts", "num_experts") if key in model)
        if axis is not None and value and value % sizes[axis]:
            raise ConfigError(f"parallelism.{axis}: {sizes[axis]} does not divide model {name} {value} "
                              f"({number} of {source}; parallelism.rules.{name} is {axis})")
    unused = set(NOT_A_PARAMETER_AXIS) | ({"expert"} if not model["num_experts"] else set())
    for axis, size in sizes.items():
        names = sorted(name for name, target in parallelism.rules.items() if target == axis)
        if size > 1 and set(names) <= unused:
            raise ConfigError(f"parallelism.{axis}: {size} devices, but this model has no parameter split over them "
                              f"(parallelism.rules maps {names or 'nothing'} to {axis}; the model has no such axis)")


def check_pair_buckets(cfg: AppConfig, numbers: Callable[[], tuple[str, dict[str, Any]]]) -> None:
    """The largest pairs bucket given holds one decode token at the whole context."""
    pairs, page_size = cfg.worker.pair_buckets, cfg.scheduler.page_size
    if not pairs:
        return  # the worker's own list grows until one does
    context = cfg.model.max_model_len or numbers()[1].get("max_position_embeddings")
    pages_per_request = -(-context // page_size) if context else 0
    if pairs[-1] < pages_per_request:
        raise ConfigError(f"worker.pair_buckets: the largest ({pairs[-1]}) must hold a whole context of "
                          f"{pages_per_request} pages (model.max_model_len {context} / scheduler.page_size {page_size})")


def check_hybrid(cfg: AppConfig, numbers: Callable[[], tuple[str, dict[str, Any]]]) -> None:
    """A hybrid (HYBRID: linear-attention layers keeping a per-request state) runs without
    speculation for now: a rejected draft would have to roll that state back. (Its prefix cache
    keeps state snapshots: scheduler_svc/snapshots.py.)"""
    source, model = numbers()
    name = hybrid(model)
    if name is None:
        return
    if cfg.scheduler.speculative != "none":
        raise ConfigError(f"scheduler.speculative: {name} ({source}) cannot roll back its linear layers' recurrent "
                          "state after a rejected draft yet: set scheduler.speculative=none")
