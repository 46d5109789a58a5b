"""What the worker serves, as the foundation knows it (it imports no service): the architecture names
worker_svc/models registers (tests/model/test_families.py holds the two lists equal), so preflight.py
refuses any other before a service starts; and the attention window a checkpoint's config makes its
layers slide by, read as transformers 5 reads it.

Sliding-window attention is not implemented: a layer attends every earlier position. That equals a
window exactly when the window is not smaller than the context, since a token at position p attends
the positions from p - window + 1 (transformers' sliding mask: kv > q - window) and p < context.
So a window below the context is refused by name (the model files, against the config's
max_position_embeddings; preflight, against the served context too), and any other is served.
"""

from __future__ import annotations

from typing import Any

SERVED = ("GptOssForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
          "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
QWEN2_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2Config default: layers from this index on slide, when any does


def _every_layer(config: dict[str, Any]) -> int | None:
    """Mistral and Mixtral (transformers' MistralModel, MixtralModel): every layer slides by
    sliding_window whenever it is set; `layer_types` is not read."""
    return config.get("sliding_window")


def _qwen2(config: dict[str, Any]) -> int | None:
    """Qwen2 (transformers' Qwen2Config): sliding_window counts only under use_sliding_window, for the
    layers `layer_types` names sliding_attention, or where it is not given, those from
    max_window_layers on."""
    window = config.get("sliding_window")
    if not config.get("use_sliding_window") or window is None:
        return None
    first = config.get("max_window_layers", QWEN2_MAX_WINDOW_LAYERS)
    types = config.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                          for i in range(config.get("num_hidden_layers", 0))]
    return window if "sliding_attention" in types else None


WINDOWS = {"MistralForCausalLM": _every_layer, "MixtralForCausalLM": _every_layer, "Qwen2ForCausalLM": _qwen2}


def sliding_window(config: dict[str, Any]) -> int | None:
    """The window some layer of the config's architecture slides by; None when none slides (or the
    architecture is one whose model file refuses a window itself: Qwen3, Qwen3-MoE)."""
    for name in config.get("architectures") or []:
        if name in WINDOWS:
            return WINDOWS[name](config)
    return None


def sliding_refusal(model: str, config: dict[str, Any], context: int | None) -> str | None:
    """Why `model` cannot serve `config` over a context of `context` tokens (None: unknown, as small
    as 1), or None when no layer's window is below it."""
    window = sliding_window(config)
    if window is None or (context is not None and window >= context):
        return None
    bound = f"the context of {context}" if context is not None else "a context the config does not bound"
    return (f"{model} with sliding-window attention (sliding_window={window}) is not supported yet; its layers attend "
            f"only the last {window} positions, fewer than {bound} (a window of at least the context, or null, is served)")
