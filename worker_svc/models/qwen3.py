"""Qwen3 (Qwen Team, 2025), the dense models: Llama's pre-norm decoder of grouped-query attention
with rotary positions and a SwiGLU MLP, plus an RMSNorm over each head's dimensions on the queries
and keys (QK-norm) before rotary. Its head dimension is a config number of its own (Qwen3-0.6B:
16 heads of 128 in a 1024-wide model), its attention has no bias, and its LM head is tied to the
embedding or not, as the config says.

Not here: sliding-window attention (released Qwen3 configs leave it off) and rotary scaling (YaRN); a config
asking for either, or for attention biases, is refused rather than served wrong.

Around the layer, as for Llama, layers/decoder.py: the embedding, the stacked layers run with
`jax.lax.scan`, the final norm and the LM head.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.decoder import Decoder
from worker_svc.models.llama import CHECKPOINT as LLAMA_CHECKPOINT
from worker_svc.models.llama import DecoderLayer, LlamaConfig, Transform


class Qwen3Config(LlamaConfig):
    """Llama's numbers; head_dim is always in the config (both readers fill it: not hidden / heads
    when absent, see hf_dir.py) and norm_eps is the per-head q and k norms' too."""

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> "Qwen3Config":
        _refuse_unsupported(c)
        return super().from_hf(c)


def _refuse_unsupported(c: dict[str, Any]) -> None:
    if c.get("attention_bias"):
        raise ValueError("Qwen3 with attention_bias true is not supported (q/k/v/o biases are not implemented)")
    if c.get("use_sliding_window") or "sliding_attention" in (c.get("layer_types") or []):
        raise ValueError("Qwen3 with sliding-window attention (use_sliding_window / layer_types) is not supported")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"Qwen3 with rope_type {kind!r} is not supported (only the default rotary)")


def decoder_layer(cfg: Qwen3Config, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> DecoderLayer:
    """Llama's layer, with each head's queries and keys RMS-normalized before rotary (QK-norm)."""
    return DecoderLayer(cfg, qk_norm=True, dtype=dtype, rngs=rngs)


class Qwen3(Decoder):
    def __init__(self, cfg: Qwen3Config, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs) -> None:
        super().__init__(cfg, lambda r: decoder_layer(cfg, dtype=dtype, rngs=r), dtype=dtype, rngs=rngs)


# ---------------------------------------------------------------------------------------------
# Checkpoint names: Llama's (same Hugging Face names and layouts; the Q, K, V and O reshapes read
# heads and head_dim from the config, so a head_dim that is not dim / heads is handled), plus the
# per-head norms. GGUF files reach these same names through gguf_file.py's qwen3 table
# (attn_q_norm -> self_attn.q_norm, attn_k_norm -> self_attn.k_norm).


def _same(w, cfg):
    return w


CHECKPOINT: dict[tuple[str, ...], tuple[str, Transform]] = LLAMA_CHECKPOINT | {
    ("layers", "attn", "q_norm", "scale"): ("model.layers.{i}.self_attn.q_norm.weight", _same),  # [H]
    ("layers", "attn", "k_norm", "scale"): ("model.layers.{i}.self_attn.k_norm.weight", _same),  # [H]
}

TO_HF: dict[Transform, Transform] = {_same: _same}  # each transform above's inverse (llama.py's TO_HF)
