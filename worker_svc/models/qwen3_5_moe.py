"""Qwen3.5-MoE and Qwen3-Next (Qwen Team): Qwen3.5's hybrid of Gated DeltaNet and gated full
attention (qwen3_5.py) with a mixture of experts for the MLP: top-k of E routed experts
(layers/moe.py, `moe=fused` or `ep`), plus one shared expert, a SwiGLU whose output is scaled by
sigmoid of its own gate (a [D] projection), added to every token's.

Qwen3.5-MoE: every layer's MLP is a MoE, its router always renormalizes the top k. Qwen3-Next: the
layers of `mlp_only_layers`, or off `decoder_sparse_step`, are dense; its router renormalizes under
norm_topk_prob; its linear layers' input projections are fused by key head (in_proj_qkvz,
in_proj_ba), read as they lie (layers/delta_net.py's `fused`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.mlp import SwiGLU
from worker_svc.layers.moe import ExpertShards, MoE
from worker_svc.models import qwen3_5
from worker_svc.models.llama import Transform
from worker_svc.models.qwen3_5 import HybridLayer, Qwen3_5, Qwen3_5Config


@dataclass(frozen=True)
class Qwen3_5MoeConfig(Qwen3_5Config):
    experts: int = 0  # E
    top_k: int = 0  # k, experts per token
    moe_mlp_dim: int = 0  # F of each expert
    shared_mlp_dim: int = 0  # F of the shared expert
    norm_topk_prob: bool = True
    # Serving choices (loading.py, as for Qwen3-MoE): the strategy and, for `ep`, where the experts live.
    moe: str = "fused"
    shards: ExpertShards | None = None

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> "Qwen3_5MoeConfig":
        c = c.get("text_config") or c
        # Qwen3.5-MoE's config has no intermediate_size: no layer of it has a dense MLP (Qwen3-Next's may)
        base = super().from_hf({"intermediate_size": 0, **c})
        experts = c.get("num_experts", 0)
        if experts < 1 or c.get("num_experts_per_tok", 0) < 1:
            raise ValueError(f"{cls.__name__.removesuffix('Config')} needs num_experts and num_experts_per_tok >= 1")
        return replace(base, experts=experts, top_k=c["num_experts_per_tok"], moe_mlp_dim=c["moe_intermediate_size"],
                       shared_mlp_dim=c["shared_expert_intermediate_size"], moe_layers=cls.moe_layers_of(c, base.layers),
                       norm_topk_prob=bool(c.get("norm_topk_prob", True)))

    @staticmethod
    def moe_layers_of(c: dict[str, Any], layers: int) -> tuple[int, ...]:
        return tuple(range(layers))  # Qwen3.5-MoE: every layer


@dataclass(frozen=True)
class Qwen3NextConfig(Qwen3_5MoeConfig):
    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> "Qwen3NextConfig":
        return replace(super().from_hf(c), fused_projections=True)

    @staticmethod
    def moe_layers_of(c: dict[str, Any], layers: int) -> tuple[int, ...]:
        step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or [])
        if step < 1:
            raise ValueError(f"Qwen3-Next with decoder_sparse_step {step} is not supported (must be >= 1)")
        return tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)


class SharedExpertMoE(nnx.Module):
    """Routed experts plus a shared one gated per token: moe(x) + sigmoid(x . w) * shared(x)."""

    def __init__(self, cfg: Qwen3_5MoeConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.moe = MoE(cfg.dim, cfg.moe_mlp_dim, cfg.experts, cfg.top_k, norm_topk_prob=cfg.norm_topk_prob, strategy=cfg.moe,
                       numerics=cfg.numerics, dtype=dtype, rngs=rngs, shards=cfg.shards)
        self.shared = SwiGLU(cfg.dim, cfg.shared_mlp_dim, numerics=cfg.numerics, dtype=dtype, rngs=rngs)
        self.shared_gate = nnx.Param((jax.random.normal(rngs.params(), (cfg.dim,)) * cfg.dim**-0.5).astype(dtype),
                                     out_sharding=("embed",), eager_sharding=False)  # [D]

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = jax.nn.sigmoid((x @ self.shared_gate[...]).astype(jnp.float32))[:, None]  # [T, 1]
        return self.moe(x) + (gate * self.shared(x).astype(jnp.float32)).astype(x.dtype)


class MoeHybridLayer(HybridLayer):
    def make_mlp(self, cfg, moe, dtype, rngs):
        return SharedExpertMoE(cfg, dtype=dtype, rngs=rngs) if moe else super().make_mlp(cfg, moe, dtype, rngs)


class Qwen3_5Moe(Qwen3_5):
    layer = MoeHybridLayer


class Qwen3Next(Qwen3_5Moe):
    pass


# ---------------------------------------------------------------------------------------------
# Checkpoint names: Qwen3.5's, the MoE MLP's (the router, each expert's Linear as save_pretrained
# writes them, the shared expert and its gate), and Qwen3-Next's fused linear projections.


def _same(w, cfg):
    return w


def _linear(w, cfg):  # HF Linear [out, in] -> [in, out]
    return w.T


def _row(w, cfg):  # [1, D] -> [D]
    return w[0]


def _row_to_hf(w, cfg):
    return w[None]


def _by_key_head(w, cfg):  # [Nk * W, D] -> [D, Nk, W]
    return w.reshape(cfg.linear_key_heads, -1, cfg.dim).transpose(2, 0, 1)


def _by_key_head_to_hf(w, cfg):  # [D, Nk, W] -> [Nk * W, D]
    return w.transpose(1, 2, 0).reshape(-1, cfg.dim)


_MOE_MLP = {
    ("mlp", "moe", "router", "w"): ("model.layers.{i}.mlp.gate.weight", _linear),  # [E, D] -> [D, E]
    ("mlp", "moe", "experts", "gate"): ("model.layers.{i}.mlp.experts.{j}.gate_proj.weight", _linear),
    ("mlp", "moe", "experts", "up"): ("model.layers.{i}.mlp.experts.{j}.up_proj.weight", _linear),
    ("mlp", "moe", "experts", "down"): ("model.layers.{i}.mlp.experts.{j}.down_proj.weight", _linear),
    ("mlp", "shared", "gate"): ("model.layers.{i}.mlp.shared_expert.gate_proj.weight", _linear),
    ("mlp", "shared", "up"): ("model.layers.{i}.mlp.shared_expert.up_proj.weight", _linear),
    ("mlp", "shared", "down"): ("model.layers.{i}.mlp.shared_expert.down_proj.weight", _linear),
    ("mlp", "shared_gate"): ("model.layers.{i}.mlp.shared_expert_gate.weight", _row),
}
_NEXT_LINEAR = {key: value for key, value in qwen3_5.LINEAR.items() if key[1] not in ("qkv", "z", "b", "a")} | {
    ("attn", "qkvz"): ("model.layers.{i}.linear_attn.in_proj_qkvz.weight", _by_key_head),
    ("attn", "ba"): ("model.layers.{i}.linear_attn.in_proj_ba.weight", _by_key_head),
}

CHECKPOINT: dict[tuple[str, ...], tuple[str, Transform]] = qwen3_5.checkpoint(qwen3_5.LINEAR, None, _MOE_MLP)
NEXT_CHECKPOINT: dict[tuple[str, ...], tuple[str, Transform]] = qwen3_5.checkpoint(_NEXT_LINEAR, qwen3_5.DENSE_MLP, _MOE_MLP)
TO_HF: dict[Transform, Transform] = {_same: _same, _linear: _linear, _row: _row_to_hf, _by_key_head: _by_key_head_to_hf}
