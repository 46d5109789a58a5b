"""Qwen2 and Qwen2.5 (Qwen Team, 2024): Llama's pre-norm decoder of grouped-query attention with
rotary positions and a SwiGLU MLP, plus a bias on each head's queries, keys and values (none on the
output projection, none in the MLP). No QK-norm; the LM head tied to the embedding or not, as the
config says (Qwen2.5-0.5B ties it, Qwen2.5-7B does not).

Sliding-window attention under `use_sliding_window` (released Qwen2.5 configs leave it off): the
layers transformers makes slide (jaxstream/architectures.py: `layer_types`, else those from
max_window_layers on) attend the last `sliding_window` positions, the others every earlier one.

Not here: rotary scalings other than Llama's (the YaRN that Qwen2.5's long-context recipe adds to
the config); a config asking for one is refused by name rather than served wrong.

Around the layer, as for Llama, layers/decoder.py: the embedding, the stacked layers run with
`jax.lax.scan`, the final norm and the LM head.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxstream.architectures import qwen2_windows
from worker_svc.layers.decoder import Decoder
from worker_svc.models.llama import CHECKPOINT as LLAMA_CHECKPOINT
from worker_svc.models.llama import DecoderLayer, LlamaConfig, Transform


class Qwen2Config(LlamaConfig):
    """Llama's numbers and refusals (rotary scaling: none or llama3's), and each layer's window."""

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> "Qwen2Config":
        return replace(super().from_hf(c), windows=qwen2_windows(c))


class Qwen2(Decoder):
    def __init__(self, cfg: Qwen2Config, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs) -> None:
        super().__init__(cfg, lambda r: DecoderLayer(cfg, qkv_bias=True, dtype=dtype, rngs=r), dtype=dtype, rngs=rngs)


# ---------------------------------------------------------------------------------------------
# Checkpoint names: Llama's, plus the q, k and v biases, each [heads * head_dim] in the checkpoint.


def _q_bias(w, cfg):  # [N*H] -> [N, H]
    return w.reshape(cfg.heads, cfg.head_dim)


def _kv_bias(w, cfg):  # [K*H] -> [K, H]
    return w.reshape(cfg.kv_heads, cfg.head_dim)


def _flat(w, cfg):  # [N, H] or [K, H] -> [N*H] or [K*H]: both transforms' inverse
    return w.reshape(-1)


CHECKPOINT: dict[tuple[str, ...], tuple[str, Transform]] = LLAMA_CHECKPOINT | {
    ("layers", "attn", "q_bias"): ("model.layers.{i}.self_attn.q_proj.bias", _q_bias),
    ("layers", "attn", "k_bias"): ("model.layers.{i}.self_attn.k_proj.bias", _kv_bias),
    ("layers", "attn", "v_bias"): ("model.layers.{i}.self_attn.v_proj.bias", _kv_bias),
}

TO_HF: dict[Transform, Transform] = {_q_bias: _flat, _kv_bias: _flat}  # each transform above's inverse (llama.py's TO_HF)
