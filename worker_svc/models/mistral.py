"""Mistral 7B (Jiang et al., 2023): Llama's architecture (pre-norm decoder layers of grouped-query
attention with rotary positions and a SwiGLU MLP, RMSNorm, an untied LM head), with its head
dimension a config number of its own, and sliding-window attention when the config sets
`sliding_window`: Mistral-7B-v0.1 slides by 4096 over a 32768 context; v0.2 and v0.3 set it null.

Not here: sliding-window attention itself. A window smaller than the context (transformers 5 slides
every layer by it, jaxstream/architectures.py) is refused by name rather than served wrong; a null
window, or one not smaller than the context, is full attention, which is what this serves. So are
Llama's other refusals (biases, activations other than SiLU, rotary scalings but llama3's).

Layers and checkpoint names are Llama's (llama.py): Mistral's tensors carry the same names.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxstream.architectures import sliding_refusal
from worker_svc.layers.decoder import Decoder
from worker_svc.models.llama import CHECKPOINT as LLAMA_CHECKPOINT
from worker_svc.models.llama import DecoderLayer, LlamaConfig, Transform


class MistralConfig(LlamaConfig):
    """Llama's numbers and refusals, and no window smaller than max_position_embeddings (preflight
    also checks it against the served context, model.max_model_len)."""

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> "MistralConfig":
        model = cls.__name__.removesuffix("Config")  # Mistral, or Mixtral
        refused = sliding_refusal(model, c, c.get("max_position_embeddings"))
        if refused:
            raise ValueError(refused)
        return super().from_hf(c)


class Mistral(Decoder):
    def __init__(self, cfg: MistralConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs) -> None:
        super().__init__(cfg, lambda r: DecoderLayer(cfg, dtype=dtype, rngs=r), dtype=dtype, rngs=rngs)


CHECKPOINT: dict[tuple[str, ...], tuple[str, Transform]] = dict(LLAMA_CHECKPOINT)
TO_HF: dict[Transform, Transform] = {}  # Llama's transforms, whose inverses llama.py's TO_HF holds
