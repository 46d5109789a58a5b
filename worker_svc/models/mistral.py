"""Mistral 7B (Jiang et al., 2023): Llama's architecture (pre-norm decoder layers of grouped-query
attention with rotary positions and a SwiGLU MLP, RMSNorm, an untied LM head), with its head
dimension a config number of its own, and sliding-window attention when the config sets
`sliding_window`: Mistral-7B-v0.1 slides every layer by 4096 over a 32768 context
(jaxstream/architectures.py reads it as transformers 5 does); v0.2 and v0.3 set it null.

Not here, refused as for Llama: biases, activations other than SiLU, rotary scalings but llama3's.

Layers and checkpoint names are Llama's (llama.py): Mistral's tensors carry the same names.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxstream.architectures import every_layer_windows
from worker_svc.layers.decoder import Decoder
from worker_svc.models.llama import CHECKPOINT as LLAMA_CHECKPOINT
from worker_svc.models.llama import DecoderLayer, LlamaConfig, Transform


class MistralConfig(LlamaConfig):
    """Llama's numbers and refusals, and every layer's window."""

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> "MistralConfig":
        return replace(super().from_hf(c), windows=every_layer_windows(c))


class Mistral(Decoder):
    def __init__(self, cfg: MistralConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs) -> None:
        super().__init__(cfg, lambda r: DecoderLayer(cfg, dtype=dtype, rngs=r), dtype=dtype, rngs=rngs)


CHECKPOINT: dict[tuple[str, ...], tuple[str, Transform]] = dict(LLAMA_CHECKPOINT)
TO_HF: dict[Transform, Transform] = {}  # Llama's transforms, whose inverses llama.py's TO_HF holds
