"""What the worker serves, as the foundation knows it (it imports no service): the architecture names
worker_svc/models registers (tests/model/test_families.py holds the two lists equal), so preflight.py
refuses any other before a service starts; and the attention window a checkpoint's config makes each
of its layers slide by, read as transformers 5 reads it (each family's reader below); and the
head size a config implies where it states none (`head_dim`), which the worker and the KV memory
figure read alike.

A layer with a window w attends, from a token at position p, the positions p - w + 1 .. p
(transformers' sliding mask: kv > q - window); the model files hand each layer's window to its
attention (worker_svc/layers/attention.py), which masks the rest and, decoding, reads only the
cache pages inside it.
"""

from __future__ import annotations

from typing import Any

SERVED = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM",
          "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
          "Qwen3MoeForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
# Hybrids of linear and full attention: their linear layers keep a per-request state, not KV pages
# (worker_svc/layers/delta_net.py): the prefix cache keeps snapshots of it (scheduler_svc/snapshots.py),
# and draft verification does not yet handle it.
HYBRID = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
# transformers' head_dim default by model_type, where it is not hidden_size / num_attention_heads
HEAD_DIM_DEFAULTS = {"qwen3": 128, "gpt_oss": 64, "gemma2": 256, "gemma3_text": 256}
QWEN2_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2Config default: layers from this index on slide, when any does


def hybrid(config: dict[str, Any]) -> str | None:
    """The HYBRID architecture a config.json's `architectures` names, if any."""
    return next((name for name in config.get("architectures") or [] if name in HYBRID), None)


def layer_types(config: dict[str, Any]) -> list[str]:
    """A hybrid's kind of each layer ("linear_attention" or "full_attention") as transformers reads
    Qwen3.5's and Qwen3-Next's configs: its layer_types, else every `full_attention_interval`-th
    layer full (transformers' default interval, 4), the rest linear."""
    if config.get("layer_types"):
        return list(config["layer_types"])
    interval = config.get("full_attention_interval", 4)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(config["num_hidden_layers"])]


def head_dim(config: dict[str, Any]) -> int:
    """The attention head size as transformers reads a config: its head_dim, else the model_type's
    default (HEAD_DIM_DEFAULTS), else hidden_size / num_attention_heads."""
    if config.get("head_dim") is not None:
        return int(config["head_dim"])
    return HEAD_DIM_DEFAULTS.get(config.get("model_type")) or config["hidden_size"] // config["num_attention_heads"]


def every_layer_windows(config: dict[str, Any]) -> tuple[int, ...] | None:
    """Mistral and Mixtral (transformers' MistralModel, MixtralModel): every layer slides by
    sliding_window whenever it is set; `layer_types` is not read."""
    window = config.get("sliding_window")
    return None if not window else (int(window),) * config["num_hidden_layers"]


def qwen2_windows(config: dict[str, Any]) -> tuple[int, ...] | None:
    """Qwen2 (transformers' Qwen2Config): sliding_window counts only under use_sliding_window, for the
    layers `layer_types` names sliding_attention, or where it is not given, those from
    max_window_layers on."""
    window = config.get("sliding_window")
    if not config.get("use_sliding_window") or not window:
        return None
    first = config.get("max_window_layers", QWEN2_MAX_WINDOW_LAYERS)
    types = config.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                          for i in range(config["num_hidden_layers"])]
    windows = tuple(int(window) if kind == "sliding_attention" else 0 for kind in types)
    return windows if any(windows) else None


def gpt_oss_windows(config: dict[str, Any]) -> tuple[int, ...]:
    """GPT-OSS (transformers' GptOssAttention): sliding_window (when set) for the layers `layer_types`
    names sliding_attention, by default the even ones; full attention (0) for full_attention ones.
    ValueError for another layer type, or a list not one per layer."""
    layers = config["num_hidden_layers"]
    types = config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != layers:
        raise ValueError(f"GptOss with layer_types {unknown or types} is not supported (sliding_attention or "
                         "full_attention, one per layer)")
    window = int(config.get("sliding_window") or 0)
    return tuple(window if kind == "sliding_attention" else 0 for kind in types)
