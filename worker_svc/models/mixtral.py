"""Mixtral (Jiang et al., 2024): Mistral's decoder with the SwiGLU MLP of every layer replaced by a
sparse mixture of experts. A router scores the E experts (Mixtral-8x7B: 8) for each token; softmax
over all E, the top k kept (2) and their weights renormalized to sum to 1, which is the softmax over
the k chosen logits alone; the token's output is the weighted sum of those experts' SwiGLU MLPs
(layers/moe.py, with Qwen3-MoE's `norm_topk_prob`; `fused` or `ep`, from the config's moe.strategy).
Each expert is `intermediate_size` wide; there is no shared expert and no dense layer.

Mistral's sliding window, when the config sets one (every layer's). Not here, refused as for
Mistral: biases, activations other than SiLU, rotary scalings but llama3's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.decoder import Decoder
from worker_svc.layers.moe import ExpertShards, MoE
from worker_svc.models.llama import CHECKPOINT as LLAMA_CHECKPOINT
from worker_svc.models.llama import DecoderLayer, Transform, _linear
from worker_svc.models.mistral import MistralConfig


class EveryLayerMoE:
    """A config whose every layer is a mixture of experts (Mixtral, GPT-OSS): the engine reads
    `moe_layers`, as Qwen3-MoE's field."""

    layers: int

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.layers))


def experts_of(model: str, experts: int | None, top_k: int | None) -> tuple[int, int]:
    """(E, k) of a config, refused by name unless 0 < k <= E."""
    if experts is None or top_k is None or not 0 < top_k <= experts:
        raise ValueError(f"{model} with num_experts_per_tok {top_k} of num_local_experts {experts} is not supported")
    return experts, top_k


@dataclass(frozen=True)
class MixtralConfig(EveryLayerMoE, MistralConfig):
    """Mistral's numbers (mlp_dim is each expert's F), plus the experts'."""

    experts: int = 0  # E
    top_k: int = 0  # k, experts per token
    # Serving choices, not checkpoint numbers (set by loading.py): the strategy (config moe.strategy)
    # and, for `ep` on several devices, where the experts live (sharding.Layout.expert_shards).
    moe: str = "fused"
    shards: ExpertShards | None = None

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> "MixtralConfig":
        base = super().from_hf(c)  # Mistral's refusals and numbers
        experts, top_k = experts_of("Mixtral", c.get("num_local_experts"), c.get("num_experts_per_tok"))
        return replace(base, experts=experts, top_k=top_k)


def decoder_layer(cfg: MixtralConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> DecoderLayer:
    """Mistral's layer with the SwiGLU MLP replaced by a mixture of experts, its top k renormalized."""
    moe = MoE(cfg.dim, cfg.mlp_dim, cfg.experts, cfg.top_k, norm_topk_prob=True, strategy=cfg.moe, numerics=cfg.numerics,
              dtype=dtype, rngs=rngs, shards=cfg.shards)
    return DecoderLayer(cfg, mlp=moe, dtype=dtype, rngs=rngs)


class Mixtral(Decoder):
    def __init__(self, cfg: MixtralConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs) -> None:
        super().__init__(cfg, lambda r: decoder_layer(cfg, dtype=dtype, rngs=r), dtype=dtype, rngs=rngs)


# ---------------------------------------------------------------------------------------------
# Checkpoint names: Llama's for attention, norms, embedding and head; the router and the experts
# ({j}: the expert) under block_sparse_moe, each expert's gate, down and up projections named w1, w2
# and w3, one Linear [out, in] per expert and matrix, as released checkpoints hold them and
# transformers 5 writes them (it fuses w1 and w3 in memory only).


CHECKPOINT: dict[tuple[str, ...], tuple[str, Transform]] = {key: value for key, value in LLAMA_CHECKPOINT.items()
                                                            if key[:2] != ("layers", "mlp")} | {
    ("layers", "mlp", "router", "w"): ("model.layers.{i}.block_sparse_moe.gate.weight", _linear),  # [E, D] -> [D, E]
    ("layers", "mlp", "experts", "gate"): ("model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight", _linear),  # [F, D] -> [D, F]
    ("layers", "mlp", "experts", "up"): ("model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight", _linear),  # [F, D] -> [D, F]
    ("layers", "mlp", "experts", "down"): ("model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight", _linear),  # [D, F] -> [F, D]
}

TO_HF: dict[Transform, Transform] = {}  # Llama's transforms only: llama.py's TO_HF inverts them
