"""DeepSeek-V2 and DeepSeek-V3 (DeepSeek-AI, 2024), as transformers' DeepseekV2ForCausalLM and
DeepseekV3ForCausalLM compute them; Kimi K2 and Moonlight are DeepSeek-V3's architecture.

Pre-norm decoder layers, RMSNorm, an untied LM head (or tied, as the config says):
- attention: multi-head latent attention over a latent KV cache (layers/mla.py): q through its
  low-rank projection (or directly, `q_lora_rank` null), keys and values from one normed latent
  vector per token and a rotary key shared by the heads; rotary on qk_rope_head_dim dimensions,
  interleaved pairs (V3's rope_interleave, V2 always), YaRN where the config scales it (cos and sin
  by its mscale / mscale_all_dim factor, layers/rotary.py's YarnScaling), and DeepSeek's
  softmax_scale: qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 under a scaled rotary;
- MLP: the first `first_k_dense_replace` layers a SwiGLU of intermediate_size; the rest DeepSeek's
  mixture of experts (layers/deepseek_moe.py): shared experts beside the routed ones, V3's sigmoid
  scores with a correction bias and group-limited top-k, V2's softmax, greedy or group-limited.
  The two kinds are two stacks, `dense_layers` and `moe_layers`, as Qwen3-MoE's mixed configs are:
  the layers differ in their parameters' structure, which one stack could hold only by carrying both
  MLPs in every layer. layers/decoder.py runs both in one scan, each layer switched to its stack's body.

Not here, refused by name: attention biases, activations other than SiLU, rotary scalings other
than YaRN, MoE layers at a `moe_layer_freq` other than 1, V2's norm_topk_prob (transformers' V2 does
not apply it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.decoder import Decoder
from worker_svc.layers.deepseek_moe import MOE_CHECKPOINT, DeepseekMoE
from worker_svc.layers.deepseek_moe import TO_HF as MOE_TO_HF
from worker_svc.layers.mla import MLA
from worker_svc.layers.mlp import SwiGLU, feed_forward
from worker_svc.layers.moe import ExpertShards
from worker_svc.layers.norms import RMSNorm
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.paged import CacheSpec
from worker_svc.layers.rotary import YarnScaling
from worker_svc.models.llama import CHECKPOINT as LLAMA_CHECKPOINT
from worker_svc.models.llama import Transform, _linear, _same

TOPK_METHODS = {"DeepseekV3": ("noaux_tc",), "DeepseekV2": ("greedy", "group_limited_greedy")}


@dataclass(frozen=True)
class DeepseekConfig:
    vocab: int
    dim: int
    layers: int
    heads: int
    head_dim: int  # Dr (qk_rope_head_dim): the rotary's dimensions, as transformers' config sets head_dim
    q_lora_rank: int | None  # Rq, or None: q projected directly
    kv_lora_rank: int  # R
    nope_dim: int  # Dn (qk_nope_head_dim)
    v_dim: int  # Dv (v_head_dim)
    mlp_dim: int  # F of the dense layers
    rope_theta: float
    norm_eps: float
    tie_embeddings: bool
    scale: float  # the scores' (softmax_scale)
    interleaved: bool  # q_pe and k_pe laid out in interleaved pairs
    rope_scaling: YarnScaling | None = None
    # The mixture of experts (layers/deepseek_moe.py), in the layers `moe_layers`
    moe_layers: tuple[int, ...] = ()
    experts: int = 0  # E
    top_k: int = 0  # k
    moe_mlp_dim: int = 0  # F of each expert
    shared_experts: int = 0
    scoring: str = "sigmoid"  # "sigmoid" (V3) or "softmax" (V2)
    topk_method: str = "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    # Serving choices, not checkpoint numbers (set by loading.py)
    numerics: Numerics = Numerics()
    moe: str = "fused"
    shards: ExpertShards | None = None

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> "DeepseekConfig":
        model = cls.__name__.removesuffix("Config")  # DeepseekV3 or DeepseekV2
        if c.get("attention_bias"):
            raise ValueError(f"{model} with attention_bias true is not supported (biases are not implemented)")
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{model} with hidden_act {c['hidden_act']!r} is not supported (only silu)")
        if c.get("moe_layer_freq", 1) != 1:
            raise ValueError(f"{model} with moe_layer_freq {c['moe_layer_freq']} is not supported (only 1)")
        layers, heads = c["num_hidden_layers"], c["num_attention_heads"]
        rope_dim, nope_dim = c.get("qk_rope_head_dim", 64), c.get("qk_nope_head_dim", 128)
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        theta = float(c.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        scaling, scale = _rope_scaling(model, rope, rope_dim, theta), (nope_dim + rope_dim) ** -0.5
        if scaling is not None and rope.get("mscale_all_dim"):  # transformers' yarn_apply_mscale
            scale *= _mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
        experts = c.get("n_routed_experts") or c.get("num_local_experts") or c.get("num_experts") or 0
        first_dense = c.get("first_k_dense_replace", 3 if model == "DeepseekV3" else 0)
        moe_layers = tuple(range(first_dense, layers)) if experts else ()
        method = c.get("topk_method") or ("noaux_tc" if model == "DeepseekV3" else "greedy")
        if moe_layers and method not in TOPK_METHODS[model]:
            raise ValueError(f"{model} with topk_method {method!r} is not supported (only {', '.join(TOPK_METHODS[model])})")
        if moe_layers and model == "DeepseekV2" and c.get("norm_topk_prob"):
            raise ValueError("DeepseekV2 with norm_topk_prob true is not supported (transformers' DeepseekV2 does not apply it)")
        return cls(vocab=c["vocab_size"], dim=c["hidden_size"], layers=layers, heads=heads, head_dim=rope_dim,
                   q_lora_rank=c.get("q_lora_rank"), kv_lora_rank=c.get("kv_lora_rank", 512), nope_dim=nope_dim,
                   v_dim=c.get("v_head_dim", 128), mlp_dim=c["intermediate_size"], rope_theta=theta,
                   norm_eps=float(c.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                   scale=scale, interleaved=model == "DeepseekV2" or bool(c.get("rope_interleave", True)),
                   rope_scaling=scaling, moe_layers=moe_layers, experts=experts, top_k=c.get("num_experts_per_tok") or 0,
                   moe_mlp_dim=c.get("moe_intermediate_size", 0), shared_experts=c.get("n_shared_experts") or 0,
                   scoring="sigmoid" if model == "DeepseekV3" else "softmax", topk_method=method,
                   n_group=c.get("n_group") or 1, topk_group=c.get("topk_group") or 1,
                   norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                   routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)))


class DeepseekV3Config(DeepseekConfig):
    pass


class DeepseekV2Config(DeepseekConfig):
    pass


def _mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _rope_scaling(model: str, rope: dict[str, Any], rope_dim: int, theta: float) -> YarnScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"{model} with rope_type {kind!r} is not supported (only yarn and the default rotary)")
    missing = [key for key in ("factor", "original_max_position_embeddings") if key not in rope]
    if missing:
        raise ValueError(f"{model} with rope_type 'yarn' lacks {missing} in its rope scaling")
    return YarnScaling.of(rope, rope_dim, theta)


class DecoderLayer(nnx.Module):
    """Latent attention, then a dense SwiGLU or DeepSeek's mixture of experts (`mlp`)."""

    def __init__(self, cfg: DeepseekConfig, mlp: nnx.Module, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, numerics=cfg.numerics, dtype=dtype)
        self.attn = MLA(cfg.dim, cfg.heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, nope_dim=cfg.nope_dim,
                        rope_dim=cfg.head_dim, v_dim=cfg.v_dim, norm_eps=cfg.norm_eps, scale=cfg.scale,
                        interleaved=cfg.interleaved, numerics=cfg.numerics, dtype=dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, numerics=cfg.numerics, dtype=dtype)
        self.mlp = mlp

    def __call__(self, x, rope, cache, layer, ctx):  # x [T, D] -> ([T, D], the latent entries [T, 1, R + Dr])
        a, latent = self.attn(self.attn_norm(x), rope, cache, layer, ctx)
        h = x + a
        out = h + feed_forward(self.mlp, self.mlp_norm(h), ctx.lora, layer)
        return out, latent


def dense_layer(cfg: DeepseekConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> DecoderLayer:
    return DecoderLayer(cfg, SwiGLU(cfg.dim, cfg.mlp_dim, numerics=cfg.numerics, dtype=dtype, rngs=rngs), dtype=dtype, rngs=rngs)


def moe_layer(cfg: DeepseekConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> DecoderLayer:
    moe = DeepseekMoE(cfg.dim, cfg.moe_mlp_dim, cfg.experts, cfg.top_k, shared_experts=cfg.shared_experts, scoring=cfg.scoring,
                      topk_method=cfg.topk_method, n_group=cfg.n_group, topk_group=cfg.topk_group,
                      norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor, strategy=cfg.moe,
                      numerics=cfg.numerics, dtype=dtype, rngs=rngs, shards=cfg.shards)
    return DecoderLayer(cfg, moe, dtype=dtype, rngs=rngs)


class Deepseek(Decoder):
    """Stacks `dense_layers` and `moe_layers`, each present when it has a layer; a latent cache."""

    def __init__(self, cfg: DeepseekConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs) -> None:
        dense = tuple(i for i in range(cfg.layers) if i not in cfg.moe_layers)
        stacks = {
            "dense_layers": (lambda r: dense_layer(cfg, dtype=dtype, rngs=r), dense),
            "moe_layers": (lambda r: moe_layer(cfg, dtype=dtype, rngs=r), cfg.moe_layers),
        }
        super().__init__(cfg, {name: stack for name, stack in stacks.items() if stack[1]}, dtype=dtype, rngs=rngs)

    def cache_spec(self) -> CacheSpec:
        return CacheSpec.latent(self.cfg.kv_lora_rank + self.cfg.head_dim)


class DeepseekV3(Deepseek):
    pass


class DeepseekV2(Deepseek):
    pass


# ---------------------------------------------------------------------------------------------
# Checkpoint names: Llama's for the embedding, the norms, the dense MLP and the head; MLA's
# projections; the experts' (layers/deepseek_moe.py's MOE_CHECKPOINT) in the MoE stack.


def _heads(w, cfg):  # HF Linear [N*X, I] -> [I, N, X]
    return w.reshape(cfg.heads, -1, w.shape[1]).transpose(2, 0, 1)


def _heads_to_hf(w, cfg):  # [I, N, X] -> [N*X, I]
    return w.transpose(1, 2, 0).reshape(-1, w.shape[0])


def _o(w, cfg):  # [D, N*Dv] -> [N, Dv, D]
    return w.reshape(w.shape[0], cfg.heads, -1).transpose(1, 2, 0)


def _o_to_hf(w, cfg):  # [N, Dv, D] -> [D, N*Dv]
    return w.transpose(2, 0, 1).reshape(w.shape[2], -1)


_ATTENTION: dict[tuple[str, ...], tuple[str, Transform]] = {
    ("attn_norm", "scale"): ("model.layers.{i}.input_layernorm.weight", _same),
    ("attn", "q"): ("model.layers.{i}.self_attn.q_proj.weight", _heads),  # [N*(Dn+Dr), D]
    ("attn", "q_a"): ("model.layers.{i}.self_attn.q_a_proj.weight", _linear),  # [Rq, D]
    ("attn", "q_a_norm", "scale"): ("model.layers.{i}.self_attn.q_a_layernorm.weight", _same),
    ("attn", "q_b"): ("model.layers.{i}.self_attn.q_b_proj.weight", _heads),  # [N*(Dn+Dr), Rq]
    ("attn", "kv_a"): ("model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", _linear),  # [R+Dr, D]
    ("attn", "kv_a_norm", "scale"): ("model.layers.{i}.self_attn.kv_a_layernorm.weight", _same),
    ("attn", "kv_b"): ("model.layers.{i}.self_attn.kv_b_proj.weight", _heads),  # [N*(Dn+Dv), R]
    ("attn", "o"): ("model.layers.{i}.self_attn.o_proj.weight", _o),  # [D, N*Dv]
    ("mlp_norm", "scale"): ("model.layers.{i}.post_attention_layernorm.weight", _same),
}
_DENSE_MLP = {key[1:]: value for key, value in LLAMA_CHECKPOINT.items() if key[:2] == ("layers", "mlp")}


CHECKPOINT: dict[tuple[str, ...], tuple[str, Transform]] = {
    **{key: value for key, value in LLAMA_CHECKPOINT.items() if key[0] != "layers"},
    **{("dense_layers", *key): value for key, value in (_ATTENTION | _DENSE_MLP).items()},
    **{("moe_layers", *key): value for key, value in (_ATTENTION | MOE_CHECKPOINT).items()},
}

TO_HF: dict[Transform, Transform] = {_heads: _heads_to_hf, _o: _o_to_hf} | MOE_TO_HF  # each transform above's inverse
