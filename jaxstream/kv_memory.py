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
`storage_dtype`. A hybrid of linear and full attention (Qwen3.5, Qwen3-Next: a config with
linear_* numbers) holds pages for its full-attention layers alone (`layer_types`), and beside them a
fixed-size float32 state per request slot and linear layer (`state_bytes_per_slot`: the
convolution's last W - 1 inputs and the delta rule's [N, Dk, Dv] matrix). The pool of those states
has `state_rows` rows and comes out of scheduler.kv_cache_memory_gib before the pages are sized.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxstream.architectures import head_dim, hybrid, layer_types
from jaxstream.config import AppConfig, ConfigError

GIB = 1 << 30
STATE_BYTES = 4  # a recurrent state's number: float32, whatever the model's dtype (the recurrence accumulates)


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
    if hybrid(hf_config) is not None:  # only its full-attention layers hold pages
        layers = layer_types(hf_config).count("full_attention")
    kv_heads = hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]
    return layers * 2 * kv_heads * head_dim(hf_config) * kv_dtype_bytes


def state_bytes_per_slot(hf_config: dict[str, Any]) -> int:
    """One request slot's recurrent state over every linear layer, in bytes (0 for a model without
    linear layers): per layer (W - 1) x C convolution inputs, C = 2 Nk Dk + N Dv, and N x Dk x Dv
    for the delta rule, float32 (worker_svc/layers/paged.py's STATE_DTYPE). KeyError naming the
    number it lacks."""
    if hybrid(hf_config) is None:
        return 0
    linear = layer_types(hf_config).count("linear_attention")
    key_heads, value_heads = hf_config["linear_num_key_heads"], hf_config["linear_num_value_heads"]
    key_dim, value_dim = hf_config["linear_key_head_dim"], hf_config["linear_value_head_dim"]
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    return linear * ((hf_config["linear_conv_kernel_dim"] - 1) * channels + value_heads * key_dim * value_dim) * STATE_BYTES


def state_snapshots(cfg: AppConfig) -> int:
    """The state rows a hybrid's prefix cache keeps (scheduler.state_snapshots; none with the prefix cache off)."""
    return cfg.scheduler.state_snapshots if cfg.scheduler.prefix_cache else 0


def state_rows(cfg: AppConfig) -> int:
    """The rows of a hybrid's per-request state arrays (worker_svc/layers/paged.py): one per request
    slot (scheduler.max_running_requests), then the prefix cache's snapshots."""
    return cfg.scheduler.max_running_requests + state_snapshots(cfg)


def state_memory(cfg: AppConfig, hf_config: dict[str, Any]) -> int:
    """The bytes of a hybrid's state pool (0 for another model): state_rows x state_bytes_per_slot."""
    return state_rows(cfg) * state_bytes_per_slot(hf_config)


def page_pool(cfg: AppConfig, numbers: Callable[[], tuple[str, dict[str, Any]]]) -> int:
    """scheduler.num_pages, or where scheduler.kv_cache_memory_gib sizes the pool, the pages that
    memory holds once a hybrid's state pool is taken out of it (`state_memory`): floor((memory -
    states) / (page_size x the model's KV bytes per token)). `numbers`: (where they come from, the
    model's config.json numbers), as jaxstream/preflight.py reads them, asked only then. A
    ConfigError naming the key when the model's numbers cannot say, or the memory holds no page
    beside the states."""
    s = cfg.scheduler
    if s.kv_cache_memory_gib is None:
        return s.num_pages
    key = "scheduler.kv_cache_memory_gib"
    source, config = numbers()
    try:
        per_token = kv_bytes_per_token(config, kv_dtype_bytes(cfg.worker.dtype, cfg.worker.kv_cache_dtype))
        states = state_memory(cfg, config)
    except KeyError as exc:
        raise ConfigError(f"{key}: sizing the KV pool needs the model's {exc.args[0]}, which {source} does not state "
                          "(set scheduler.num_pages instead)") from None
    pages = (int(s.kv_cache_memory_gib * GIB) - states) // (s.page_size * per_token)
    if pages < 1:
        beside = "" if not states else (f" beside the linear layers' states ({state_rows(cfg)} slots, "
                                        f"scheduler.max_running_requests, x {state_bytes_per_slot(config)} bytes)")
        raise ConfigError(f"{key}: {s.kv_cache_memory_gib:g} GiB holds no page of {s.page_size} tokens at {per_token} bytes "
                          f"a token{beside} ({source}, worker.dtype {cfg.worker.dtype}, worker.kv_cache_dtype {cfg.worker.kv_cache_dtype})")
    return pages


def summary(cfg: AppConfig, hf_config: dict[str, Any]) -> str:
    """The cache's memory in one line, as `jaxstream config` and the worker's start-up show it: the
    page pool (scheduler.num_pages, sized by now) and a hybrid's state pool."""
    s = cfg.scheduler
    per_token = kv_bytes_per_token(hf_config, kv_dtype_bytes(cfg.worker.dtype, cfg.worker.kv_cache_dtype))
    line = (f"KV pages: {s.num_pages} of {s.page_size} tokens at {per_token} bytes a token, "
            f"{s.num_pages * s.page_size * per_token / 1e6:.1f} MB")
    if hybrid(hf_config) is not None:
        line += (f"; recurrent states: {state_rows(cfg)} slots (scheduler.max_running_requests) of {state_bytes_per_slot(hf_config)} "
                 f"bytes, {state_memory(cfg, hf_config) / 1e6:.1f} MB")
    return line
