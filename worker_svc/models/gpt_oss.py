"""GPT-OSS (OpenAI, 2025): pre-norm decoder layers of grouped-query attention and a mixture of experts
in every layer, RMSNorm, an untied LM head; as transformers' GptOssForCausalLM computes it.

- Attention: q, k, v and o with biases; a learned sink logit per query head, in the softmax's
  denominator only; layers alternating between a sliding window (`sliding_window`, 128 in the released
  models) and full attention, as `layer_types` says (by default layer i slides when i is even). The
  windows are data, one per layer (Attention's `windows`), so the stack stays one scanned body.
- Rotary: YaRN (rope_type `yarn`: factor 32 over 4096 positions, beta_fast 32, beta_slow 1), cos and
  sin scaled by its attention factor (layers/rotary.py's YarnScaling).
- Mixture of experts (layers/moe.py): a router with a bias takes the top k of its logits (4 of 32 in
  gpt-oss-20b, of 128 in -120b), then a softmax over those k alone; each expert's gate and up
  projections are one matrix with a bias, then the clamped SwiGLU (the gate clamped above at
  `swiglu_limit`, up to +-limit, gate * sigmoid(1.702 gate) * (up + 1)), then down with a bias.

The released checkpoints hold the experts' matrices in MXFP4; the reader dequantizes them
(worker_svc/weights/mxfp4.py), so the names below are those of the float tensors transformers saves.

Not here, refused by name: rotary scalings other than YaRN, a partial rotary factor, layer types
other than sliding and full attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxstream.architectures import gpt_oss_windows
from worker_svc.layers.decoder import Decoder
from worker_svc.layers.moe import ClampedSwiGLU, ExpertShards, MoE
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.rotary import YarnScaling
from worker_svc.models.llama import DecoderLayer, Transform, _linear, _same
from worker_svc.models.mixtral import EveryLayerMoE, experts_of
from worker_svc.models.qwen2 import CHECKPOINT as QWEN2_CHECKPOINT


@dataclass(frozen=True)
class GptOssConfig(EveryLayerMoE):
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_dim: int  # F of each expert
    rope_theta: float
    norm_eps: float
    tie_embeddings: bool
    experts: int  # E
    top_k: int  # k, experts per token
    windows: tuple[int, ...]  # per layer: its sliding window, or 0 for full attention
    attention_bias: bool = True  # q, k, v and o biases
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rope_scaling: YarnScaling | None = None  # None: plain rotary
    # Serving choices, not checkpoint numbers (set by loading.py): the arithmetic (worker.*), the MoE
    # strategy (config moe.strategy) and, for `ep` on several devices, where the experts live.
    numerics: Numerics = Numerics()
    moe: str = "fused"
    shards: ExpertShards | None = None

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> "GptOssConfig":
        """From a Hugging Face config.json dict, with GptOssConfig's defaults where it is silent."""
        layers, heads = c["num_hidden_layers"], c["num_attention_heads"]
        head_dim = c.get("head_dim") or 64
        theta = float(c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta") or 150000.0)
        experts, top_k = experts_of("GptOss", c.get("num_local_experts", c.get("num_experts")),
                                    c.get("num_experts_per_tok", c.get("experts_per_token")))
        return cls(vocab=c["vocab_size"], dim=c["hidden_size"], layers=layers, heads=heads,
                   kv_heads=c.get("num_key_value_heads") or heads, head_dim=head_dim, mlp_dim=c["intermediate_size"],
                   rope_theta=theta, norm_eps=float(c.get("rms_norm_eps", 1e-5)),
                   tie_embeddings=bool(c.get("tie_word_embeddings", False)), experts=experts, top_k=top_k,
                   windows=gpt_oss_windows(c), attention_bias=bool(c.get("attention_bias", True)),
                   swiglu_alpha=float(c.get("swiglu_alpha", 1.702)), swiglu_limit=float(c.get("swiglu_limit", 7.0)),
                   rope_scaling=_rope_scaling(c, head_dim, theta))


def _rope_scaling(c: dict[str, Any], head_dim: int, theta: float) -> YarnScaling | None:
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"GptOss with rope_type {kind!r} is not supported (only yarn and the default rotary)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"GptOss with partial_rotary_factor {rope['partial_rotary_factor']} is not supported (only 1.0)")
    missing = [key for key in ("factor", "original_max_position_embeddings") if key not in rope]
    if missing:
        raise ValueError(f"GptOss with rope_type 'yarn' lacks {missing} in its rope scaling")
    return YarnScaling.of(rope, head_dim, theta)


def decoder_layer(cfg: GptOssConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> DecoderLayer:
    """Llama's layer with q, k, v and o biases, a sink per head, and the biased, clamped experts."""
    moe = MoE(cfg.dim, cfg.mlp_dim, cfg.experts, cfg.top_k, norm_topk_prob=False, strategy=cfg.moe, numerics=cfg.numerics,
              dtype=dtype, rngs=rngs, shards=cfg.shards, clamped=ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit))
    return DecoderLayer(cfg, qkv_bias=cfg.attention_bias, sinks=True, o_bias=cfg.attention_bias, mlp=moe, dtype=dtype, rngs=rngs)


class GptOss(Decoder):
    def __init__(self, cfg: GptOssConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs) -> None:
        super().__init__(cfg, lambda r: decoder_layer(cfg, dtype=dtype, rngs=r), dtype=dtype, rngs=rngs)


# ---------------------------------------------------------------------------------------------
# Checkpoint names: Qwen2's for the embedding, norms, head and attention with its q, k and v biases;
# o's bias and the sinks; the router and the experts, one tensor per layer for all E experts, as
# transformers holds them: gate_up_proj [E, D, 2F] with each expert's gate and up columns
# interleaved (gate at even columns, up at odd), down_proj [E, F, D] (ours already).


def _gate_up(w, cfg):  # [E, D, 2F] interleaved, or its bias [E, 2F] -> [E, D, 2, F] or [E, 2, F]
    return w.reshape(*w.shape[:-1], -1, 2).swapaxes(-1, -2)


def _gate_up_to_hf(w, cfg):  # [E, D, 2, F] or [E, 2, F] -> [E, D, 2F] or [E, 2F], interleaved
    return w.swapaxes(-1, -2).reshape(*w.shape[:-2], -1)


CHECKPOINT: dict[tuple[str, ...], tuple[str, Transform]] = {key: value for key, value in QWEN2_CHECKPOINT.items()
                                                            if key[:2] != ("layers", "mlp")} | {
    ("layers", "attn", "o_bias"): ("model.layers.{i}.self_attn.o_proj.bias", _same),  # [D]
    ("layers", "attn", "sinks"): ("model.layers.{i}.self_attn.sinks", _same),  # [N]
    ("layers", "mlp", "router", "w"): ("model.layers.{i}.mlp.router.weight", _linear),  # [E, D] -> [D, E]
    ("layers", "mlp", "router", "bias"): ("model.layers.{i}.mlp.router.bias", _same),  # [E]
    ("layers", "mlp", "experts", "gate_up"): ("model.layers.{i}.mlp.experts.gate_up_proj", _gate_up),
    ("layers", "mlp", "experts", "gate_up_bias"): ("model.layers.{i}.mlp.experts.gate_up_proj_bias", _gate_up),
    ("layers", "mlp", "experts", "down"): ("model.layers.{i}.mlp.experts.down_proj", _same),  # [E, F, D]
    ("layers", "mlp", "experts", "down_bias"): ("model.layers.{i}.mlp.experts.down_proj_bias", _same),  # [E, D]
}

TO_HF: dict[Transform, Transform] = {_gate_up: _gate_up_to_hf}  # each transform above's inverse (llama.py's TO_HF)
