"""The KV cache's memory per token, from a model's config.json numbers alone, and the page pool a
memory budget holds (`scheduler.kv_cache_memory_gib`).

The worker allocates its cache from the model file's own numbers (worker_svc/layers/paged.py's
CacheSpec, chosen by the model's attention); the scheduler, preflight and the gateway cannot import
the worker, so this module says the same figure from the config (tests/worker/test_kv_memory.py
holds it equal to the bytes the worker allocates, for every served family's tiny config):

- standard attention caches a key and a value per KV head and layer:
  layers x 2 x num_key_value_heads x head_dim x bytes;
- multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight: a config with kv_lora_rank)
  caches one latent vector per layer shared by every head, the normed c_kv then the rotated k_pe:
  layers x (kv_lora_rank + qk_rope_head_dim) x bytes.

The bytes are the KV storage dtype's (`kv_dtype_bytes`), the rule of worker_svc/layers/paged.py's
`storage_dtype`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxstream.architectures import head_dim
from jaxstream.config import AppConfig, ConfigError

GIB = 1 << 30


def kv_dtype_bytes(dtype: str, kv_cache_dtype: str) -> int:
    """The bytes of one cached number for worker.dtype and worker.kv_cache_dtype: bfloat16's 2 when
    either says bfloat16 (under float32 weights the cache holds bfloat16's bits), else float32's 4."""
    return 2 if "bfloat16" in (dtype, kv_cache_dtype) else 4


def kv_bytes_per_token(hf_config: dict[str, Any], kv_dtype_bytes: int) -> int:
    """The KV cache's bytes per token, over every layer, for a model of these config.json numbers.
    KeyError naming the number it lacks."""
    layers = hf_config["num_hidden_layers"]
    if hf_config.get("kv_lora_rank") is not None:  # multi-head latent attention
        return layers * (hf_config["kv_lora_rank"] + hf_config["qk_rope_head_dim"]) * kv_dtype_bytes
    kv_heads = hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]
    return layers * 2 * kv_heads * head_dim(hf_config) * kv_dtype_bytes


def state_snapshots(cfg: AppConfig) -> int:
    """The state rows a hybrid's prefix cache keeps (scheduler.state_snapshots; none with the prefix cache off)."""
    return cfg.scheduler.state_snapshots if cfg.scheduler.prefix_cache else 0


def state_rows(cfg: AppConfig) -> int:
    """The rows of a hybrid's per-request state arrays (worker_svc/layers/paged.py): one per request
    slot (scheduler.max_running_requests), then the prefix cache's snapshots."""
    return cfg.scheduler.max_running_requests + state_snapshots(cfg)


def page_pool(cfg: AppConfig, numbers: Callable[[], tuple[str, dict[str, Any]]]) -> int:
    """scheduler.num_pages, or where scheduler.kv_cache_memory_gib sizes the pool, the pages that
    memory holds: floor(memory / (page_size x the model's KV bytes per token)). `numbers`: (where
    they come from, the model's config.json numbers), as jaxstream/preflight.py reads them, asked
    only then. A ConfigError naming the key when the model's numbers cannot say, or the memory
    holds no page."""
    s = cfg.scheduler
    if s.kv_cache_memory_gib is None:
        return s.num_pages
    key = "scheduler.kv_cache_memory_gib"
    source, config = numbers()
    try:
        per_token = kv_bytes_per_token(config, kv_dtype_bytes(cfg.worker.dtype, cfg.worker.kv_cache_dtype))
    except KeyError as exc:
        raise ConfigError(f"{key}: sizing the KV pool needs the model's {exc.args[0]}, which {source} does not state "
                          "(set scheduler.num_pages instead)") from None
    pages = int(s.kv_cache_memory_gib * GIB) // (s.page_size * per_token)
    if pages < 1:
        raise ConfigError(f"{key}: {s.kv_cache_memory_gib:g} GiB holds no page of {s.page_size} tokens at {per_token} bytes "
                          f"a token ({source}, worker.dtype {cfg.worker.dtype}, worker.kv_cache_dtype {cfg.worker.kv_cache_dtype})")
    return pages
