"""Llama (Touvron et al., 2023) as served: pre-norm decoder layers of grouped-query attention with
rotary positions and a SwiGLU MLP, RMSNorm, and an LM head tied to the embedding or not.
SmolLM2 is this architecture; so is Llama 3.1, whose rotary frequencies are scaled (rope_type
`llama3`, layers/rotary.py).

Not here: other rotary scalings (linear, dynamic, YaRN, ...), attention or MLP biases, activations
other than SiLU; a config asking for any is refused rather than served wrong.

Around the layer, layers/decoder.py: the embedding, the stacked layers run with `jax.lax.scan`,
the final norm and the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from worker_svc.layers.attention import Attention
from worker_svc.layers.decoder import Decoder
from worker_svc.layers.mlp import SwiGLU, feed_forward
from worker_svc.layers.norms import RMSNorm
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.rotary import Llama3Scaling


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float
    norm_eps: float
    tie_embeddings: bool
    rope_scaling: Llama3Scaling | None = None  # None: plain rotary
    windows: tuple[int, ...] | None = None  # each layer's sliding window (0: full; None: none slides): Mistral's, Qwen2's
    # A serving choice, not a checkpoint number (set by loading.py from worker.*): how matmuls,
    # attention, the router and the head do their arithmetic.
    numerics: Numerics = Numerics()

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> "LlamaConfig":
        """From a Hugging Face config.json dict (our GGUF reader builds the same keys)."""
        model = cls.__name__.removesuffix("Config")  # Llama, or the descendant whose numbers these are
        _refuse_unsupported(model, c)
        return cls(
            vocab=c["vocab_size"],
            dim=c["hidden_size"],
            layers=c["num_hidden_layers"],
            heads=c["num_attention_heads"],
            kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            mlp_dim=c["intermediate_size"],
            rope_theta=float(c.get("rope_theta", 10000.0)),
            norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            rope_scaling=_rope_scaling(model, c),
        )


def _refuse_unsupported(model: str, c: dict[str, Any]) -> None:
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise ValueError(f"{model} with {key} true is not supported (biases are not implemented)")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{model} with hidden_act {c['hidden_act']!r} is not supported (only silu)")


def _rope_scaling(model: str, c: dict[str, Any]) -> Llama3Scaling | None:
    """The config's rotary scaling (transformers 5 names it rope_parameters, 4 rope_scaling): none,
    or llama3's; any other kind is refused by name."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"{model} with rope_type {kind!r} is not supported (only the default rotary and llama3)")
    numbers = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [key for key in numbers if key not in rope]
    if missing:
        raise ValueError(f"{model} with rope_type 'llama3' lacks {missing} in its rope scaling")
    return Llama3Scaling(float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                         int(rope["original_max_position_embeddings"]))


class DecoderLayer(nnx.Module):
    """Llama's layer. Its descendants change parts of it, not its residual lines: Qwen3 normalizes
    q and k per head (`qk_norm`), Qwen2 adds biases to q, k and v (`qkv_bias`), Qwen3-MoE and Mixtral
    swap the MLP for a mixture of experts (`mlp`), GPT-OSS adds attention sinks and o's bias (`sinks`,
    `o_bias`). `cfg`: any config with Llama's numbers and `windows` (GPT-OSS's is not a LlamaConfig)."""

    def __init__(self, cfg: LlamaConfig, *, qk_norm: bool = False, qkv_bias: bool = False, sinks: bool = False,
                 o_bias: bool = False, mlp: nnx.Module | None = None, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, numerics=cfg.numerics, dtype=dtype)
        self.attn = Attention(cfg.dim, cfg.heads, cfg.kv_heads, cfg.head_dim, qk_norm_eps=cfg.norm_eps if qk_norm else None,
                              qkv_bias=qkv_bias, windows=cfg.windows, sinks=sinks, o_bias=o_bias, numerics=cfg.numerics,
                              dtype=dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, numerics=cfg.numerics, dtype=dtype)
        self.mlp = SwiGLU(cfg.dim, cfg.mlp_dim, numerics=cfg.numerics, dtype=dtype, rngs=rngs) if mlp is None else mlp

    def __call__(self, x, rope, cache, layer, ctx):  # x [T, D] -> ([T, D], k and v [T, K, H])
        a, k, v = self.attn(self.attn_norm(x), rope, cache, layer, ctx)
        h = x + a
        out = h + feed_forward(self.mlp, self.mlp_norm(h), ctx.lora, layer)
        return out, k, v


class Llama(Decoder):
    def __init__(self, cfg: LlamaConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs) -> None:
        super().__init__(cfg, lambda r: DecoderLayer(cfg, dtype=dtype, rngs=r), dtype=dtype, rngs=rngs)


# ---------------------------------------------------------------------------------------------
# Checkpoint names: our parameter path -> (Hugging Face tensor name, HF layout -> ours).
# Layer parameters name a pattern with {i}; the loader stacks them along the layer axis.

Transform = Callable[[np.ndarray, LlamaConfig], np.ndarray]


def _linear(w, cfg):  # HF Linear [out, in] -> [in, out]
    return w.T


def _q(w, cfg):  # [N*H, D] -> [D, N, H]
    return w.reshape(cfg.heads, cfg.head_dim, cfg.dim).transpose(2, 0, 1)


def _kv(w, cfg):  # [K*H, D] -> [D, K, H]
    return w.reshape(cfg.kv_heads, cfg.head_dim, cfg.dim).transpose(2, 0, 1)


def _o(w, cfg):  # [D, N*H] -> [N, H, D]
    return w.reshape(cfg.dim, cfg.heads, cfg.head_dim).transpose(1, 2, 0)


def _same(w, cfg):
    return w


# Each transform's inverse, ours -> Hugging Face layout: what the shapes of the tensors a trainer
# pushes by name must be (worker_svc/hf_index.py), and how a test writes a model as a checkpoint.


def _q_to_hf(w, cfg):  # [D, N, H] -> [N*H, D]
    return w.transpose(1, 2, 0).reshape(cfg.heads * cfg.head_dim, cfg.dim)


def _kv_to_hf(w, cfg):  # [D, K, H] -> [K*H, D]
    return w.transpose(1, 2, 0).reshape(cfg.kv_heads * cfg.head_dim, cfg.dim)


def _o_to_hf(w, cfg):  # [N, H, D] -> [D, N*H]
    return w.transpose(2, 0, 1).reshape(cfg.dim, cfg.heads * cfg.head_dim)


TO_HF: dict[Transform, Transform] = {_same: _same, _linear: _linear, _q: _q_to_hf, _kv: _kv_to_hf, _o: _o_to_hf}

CHECKPOINT: dict[tuple[str, ...], tuple[str, Transform]] = {
    ("embed", "table"): ("model.embed_tokens.weight", _same),
    ("layers", "attn_norm", "scale"): ("model.layers.{i}.input_layernorm.weight", _same),
    ("layers", "attn", "q"): ("model.layers.{i}.self_attn.q_proj.weight", _q),
    ("layers", "attn", "k"): ("model.layers.{i}.self_attn.k_proj.weight", _kv),
    ("layers", "attn", "v"): ("model.layers.{i}.self_attn.v_proj.weight", _kv),
    ("layers", "attn", "o"): ("model.layers.{i}.self_attn.o_proj.weight", _o),
    ("layers", "mlp_norm", "scale"): ("model.layers.{i}.post_attention_layernorm.weight", _same),
    ("layers", "mlp", "gate"): ("model.layers.{i}.mlp.gate_proj.weight", _linear),
    ("layers", "mlp", "up"): ("model.layers.{i}.mlp.up_proj.weight", _linear),
    ("layers", "mlp", "down"): ("model.layers.{i}.mlp.down_proj.weight", _linear),
    ("norm", "scale"): ("model.norm.weight", _same),
    ("lm_head", "w"): ("lm_head.weight", _linear),
}
