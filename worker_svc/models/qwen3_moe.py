"""Qwen3-MoE (Qwen Team, 2025): Qwen3's decoder (grouped-query attention with QK-norm and rotary
positions, pre-norm, RMSNorm) with the SwiGLU MLP replaced by a mixture of experts in most layers:
a router picks each token's top k of E experts (Qwen3-30B-A3B: 8 of 128), each a small SwiGLU,
and weights their outputs (layers/moe.py; `fused` or `ep`, from the config's moe.strategy).

Which layers are MoE follows transformers' Qwen3MoeDecoderLayer exactly: layer i is MoE when it is
not in `mlp_only_layers`, num_experts > 0 and (i + 1) % decoder_sparse_step == 0; the others have a
dense SwiGLU of `intermediate_size`. Released Qwen3-MoE models are MoE in every layer, one scanned
stack; a config mixing the two gets a stack of each, run in layer order (layers/decoder.py).

Not here, refused as for Qwen3: attention biases, sliding-window attention, rotary scaling; and
activations other than SiLU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.decoder import Decoder
from worker_svc.layers.moe import ExpertShards, MoE
from worker_svc.models import qwen3
from worker_svc.models.llama import DecoderLayer, Transform
from worker_svc.models.qwen3 import Qwen3Config


@dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3's numbers (mlp_dim is the dense layers' intermediate_size), plus the experts'."""

    experts: int = 0  # E
    top_k: int = 0  # k, experts per token
    moe_mlp_dim: int = 0  # F of each expert
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1
    moe_layers: tuple[int, ...] = ()  # the layers with an MoE MLP; the others are dense
    # Serving choices, not checkpoint numbers (set by loading.py): the strategy (config moe.strategy)
    # and, for `ep` on several devices, where the experts live (sharding.Layout.expert_shards).
    moe: str = "fused"
    shards: ExpertShards | None = None

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> "Qwen3MoeConfig":
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Qwen3-MoE with hidden_act {c['hidden_act']!r} is not supported (only silu)")
        step = c.get("decoder_sparse_step", 1)
        if step < 1:
            raise ValueError(f"Qwen3-MoE with decoder_sparse_step {step} is not supported (must be >= 1)")
        base = super().from_hf(c)  # Qwen3's refusals and numbers
        experts = c.get("num_experts", c.get("num_local_experts", 0))  # transformers 5 saves num_local_experts
        dense_only = set(c.get("mlp_only_layers") or [])
        moe_layers = tuple(i for i in range(base.layers) if i not in dense_only and experts > 0 and (i + 1) % step == 0)
        return replace(base, experts=experts, top_k=c.get("num_experts_per_tok", 0), moe_mlp_dim=c.get("moe_intermediate_size", 0),
                       norm_topk_prob=bool(c.get("norm_topk_prob", False)), moe_layers=moe_layers)


def moe_decoder_layer(cfg: Qwen3MoeConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> DecoderLayer:
    """Qwen3's layer with the SwiGLU MLP replaced by a mixture of experts."""
    moe = MoE(cfg.dim, cfg.moe_mlp_dim, cfg.experts, cfg.top_k, norm_topk_prob=cfg.norm_topk_prob, strategy=cfg.moe,
              numerics=cfg.numerics, dtype=dtype, rngs=rngs, shards=cfg.shards)
    return DecoderLayer(cfg, qk_norm=True, mlp=moe, dtype=dtype, rngs=rngs)


class Qwen3Moe(Decoder):
    """Stacks `moe_layers` and `dense_layers` (Qwen3's own layer), each present when it has a layer."""

    def __init__(self, cfg: Qwen3MoeConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs) -> None:
        dense = tuple(i for i in range(cfg.layers) if i not in cfg.moe_layers)
        stacks = {
            "moe_layers": (lambda r: moe_decoder_layer(cfg, dtype=dtype, rngs=r), cfg.moe_layers),
            "dense_layers": (lambda r: qwen3.decoder_layer(cfg, dtype=dtype, rngs=r), dense),
        }
        super().__init__(cfg, {name: stack for name, stack in stacks.items() if stack[1]}, dtype=dtype, rngs=rngs)


# ---------------------------------------------------------------------------------------------
# Checkpoint names: Qwen3's for attention and norms in both stacks ({i} is the checkpoint's layer
# index, whichever stack holds it) and for the dense MLP; the router and per-expert tensors ({j}: the
# expert) for the MoE stack. transformers 5 holds experts fused in memory (gate_up_proj [E, 2F, D])
# but save_pretrained writes, as released checkpoints are, one Linear [out, in] per expert and matrix.


def _linear(w, cfg):  # HF Linear [out, in] -> [in, out]
    return w.T


_LAYER = {key[1:]: value for key, value in qwen3.CHECKPOINT.items() if key[0] == "layers"}
_SHARED = {key: value for key, value in qwen3.CHECKPOINT.items() if key[0] != "layers"}
_ATTENTION = {key: value for key, value in _LAYER.items() if key[0] != "mlp"}

CHECKPOINT: dict[tuple[str, ...], tuple[str, Transform]] = _SHARED | {
    **{("dense_layers", *key): value for key, value in _LAYER.items()},
    **{("moe_layers", *key): value for key, value in _ATTENTION.items()},
    ("moe_layers", "mlp", "router", "w"): ("model.layers.{i}.mlp.gate.weight", _linear),  # [E, D] -> [D, E]
    ("moe_layers", "mlp", "experts", "gate"): ("model.layers.{i}.mlp.experts.{j}.gate_proj.weight", _linear),  # [F, D] -> [D, F]
    ("moe_layers", "mlp", "experts", "up"): ("model.layers.{i}.mlp.experts.{j}.up_proj.weight", _linear),  # [F, D] -> [D, F]
    ("moe_layers", "mlp", "experts", "down"): ("model.layers.{i}.mlp.experts.{j}.down_proj.weight", _linear),  # [D, F] -> [F, D]
}

TO_HF: dict[Transform, Transform] = {_linear: _linear}  # each transform above's inverse (llama.py's TO_HF)
