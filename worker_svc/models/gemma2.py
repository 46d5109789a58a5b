"""Gemma 2 (Gemma Team, 2024): a decoder of grouped-query attention with rotary positions and a
gated MLP, like Llama's, with Gemma's differences:

- the embedding is scaled by sqrt(hidden size) (in the model dtype, as transformers rounds it), and
  the LM head is tied to it;
- every RMSNorm multiplies by (1 + w): the checkpoint's w is stored as is, and the norm adds 1;
- four norms a layer: before and after attention, before and after the MLP, the residual adding
  the normed output (`h = x + norm(attn(norm(x)))`);
- the MLP's activation is GELU's tanh approximation (`gelu_pytorch_tanh`);
- queries scaled by query_pre_attn_scalar**-0.5 (not head_dim**-0.5), each attention score
  soft-capped to (-c, c) by c * tanh(s / c) (attn_logit_softcapping), and the logits too
  (final_logit_softcapping);
- local and global layers (`layer_types`: sliding_attention attends the last `sliding_window`
  positions, full_attention all; by default every other layer from the first is local), each
  layer's window data of one scanned layer body (layers/attention.py).

Not here: attention biases, other activations, rotary scalings, bidirectional attention; a config
asking for any is refused by name rather than served wrong.

Around the layer, layers/decoder.py: the embedding, the stacked layers run with `jax.lax.scan`,
the final norm and the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.attention import Attention
from worker_svc.layers.decoder import Decoder
from worker_svc.layers.mlp import GeGLU
from worker_svc.layers.norms import RMSNorm
from worker_svc.models.llama import CHECKPOINT as LLAMA_CHECKPOINT
from worker_svc.models.llama import LlamaConfig, Transform

NORM_OFFSET = 1.0  # Gemma's RMSNorm scales by (1 + w)
LAYER_TYPES = ("sliding_attention", "full_attention")
ACTIVATION = "gelu_pytorch_tanh"


@dataclass(frozen=True)
class Gemma2Config(LlamaConfig):
    """Llama's numbers (rope_scaling always None: plain rotary; `windows` from layer_types), and Gemma's."""

    query_scale: float = 256**-0.5  # query_pre_attn_scalar**-0.5
    attn_softcap: float | None = None  # attn_logit_softcapping
    logit_softcap: float | None = None  # final_logit_softcapping

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> "Gemma2Config":
        refuse_unsupported("Gemma2", c)
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(f"Gemma2 with rope_type {kind!r} is not supported (only the default rotary)")
        return cls(**gemma_numbers("Gemma2", c, layer_types("Gemma2", c, every=2)), rope_theta=float(c.get("rope_theta", 10000.0)),
                   attn_softcap=_optional(c.get("attn_logit_softcapping", 50.0)))


def refuse_unsupported(model: str, c: dict[str, Any]) -> None:
    """What neither Gemma 2 nor Gemma 3 implements here, by name."""
    for key in ("attention_bias", "use_bidirectional_attention"):
        if c.get(key):
            raise ValueError(f"{model} with {key} true is not supported")
    activation = c.get("hidden_activation") or ACTIVATION  # transformers reads no other key (hidden_act is Gemma 1's)
    if activation != ACTIVATION:
        raise ValueError(f"{model} with hidden_activation {activation!r} is not supported (only {ACTIVATION!r})")


def gemma_numbers(model: str, c: dict[str, Any], types: list[str]) -> dict[str, Any]:
    """The numbers Gemma 2 and 3 read alike (transformers' defaults where a released config leaves
    one out), all but the rotary and the attention soft-cap; `types`, each layer's kind (layer_types)."""
    layers = c["num_hidden_layers"]
    if len(types) != layers:
        raise ValueError(f"{model}: layer_types names {len(types)} layers, num_hidden_layers is {layers}")
    window = c.get("sliding_window", 4096)
    if "sliding_attention" in types and not window:
        raise ValueError(f"{model}: layer_types has sliding_attention layers but sliding_window is {window!r}")
    return dict(
        vocab=c["vocab_size"], dim=c["hidden_size"], layers=layers, heads=c["num_attention_heads"],
        kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"], mlp_dim=c["intermediate_size"],
        norm_eps=float(c.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        query_scale=float(c.get("query_pre_attn_scalar", 256)) ** -0.5,
        logit_softcap=_optional(c.get("final_logit_softcapping", 30.0 if model == "Gemma2" else None)),
        windows=tuple(int(window) if kind == "sliding_attention" else 0 for kind in types))


def layer_types(model: str, c: dict[str, Any], every: int) -> list[str]:
    """Each layer's kind: the config's `layer_types`, or transformers' default pattern: every
    `every`-th layer full, the others sliding."""
    types = c.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention"
                                     for i in range(c["num_hidden_layers"])]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"{model} with layer_types {unknown} is not supported (only {list(LAYER_TYPES)})")
    return list(types)


def _optional(value: Any) -> float | None:
    return None if value is None else float(value)


class DecoderLayer(nnx.Module):
    """Gemma's layer: each sublayer's input and output normed. `qk_norm` (Gemma 3): q and k normed
    per head, (1 + w) too."""

    def __init__(self, cfg: Gemma2Config, *, qk_norm: bool = False, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        def norm() -> RMSNorm:
            return RMSNorm(cfg.dim, cfg.norm_eps, offset=NORM_OFFSET, numerics=cfg.numerics, dtype=dtype)

        self.attn_norm = norm()
        self.attn = Attention(cfg.dim, cfg.heads, cfg.kv_heads, cfg.head_dim, qk_norm_eps=cfg.norm_eps if qk_norm else None,
                              qk_norm_offset=NORM_OFFSET, scale=cfg.query_scale, softcap=cfg.attn_softcap,
                              windows=cfg.windows, numerics=cfg.numerics, dtype=dtype, rngs=rngs)
        self.post_attn_norm = norm()
        self.mlp_norm = norm()
        self.mlp = GeGLU(cfg.dim, cfg.mlp_dim, numerics=cfg.numerics, dtype=dtype, rngs=rngs)
        self.post_mlp_norm = norm()

    def __call__(self, x, rope, cache, layer, ctx):  # x [T, D] -> ([T, D], k and v [T, K, H])
        a, k, v = self.attn(self.attn_norm(x), rope, cache, layer, ctx)
        h = x + self.post_attn_norm(a)
        out = h + self.post_mlp_norm(self.mlp(self.mlp_norm(h), ctx.lora, layer))
        return out, k, v


class Gemma2(Decoder):
    def __init__(self, cfg: Gemma2Config, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs) -> None:
        super().__init__(cfg, lambda r: DecoderLayer(cfg, dtype=dtype, rngs=r), dtype=dtype, rngs=rngs,
                         **decoder_options(cfg))


def decoder_options(cfg: Gemma2Config) -> dict[str, Any]:
    """What Gemma changes around its layers (layers/decoder.py)."""
    return dict(embed_scale=cfg.dim**0.5, norm_offset=NORM_OFFSET, logit_softcap=cfg.logit_softcap)


# ---------------------------------------------------------------------------------------------
# Checkpoint names: Llama's tensors and layouts (llama.py), but for the norms: Gemma's
# post_attention_layernorm norms the attention's output, and the MLP's input norm is
# pre_feedforward_layernorm. Every norm's w is stored as the checkpoint holds it (the norm adds 1),
# so a weight read back by name is the checkpoint's, bit for bit.


def _same(w, cfg):
    return w


CHECKPOINT: dict[tuple[str, ...], tuple[str, Transform]] = LLAMA_CHECKPOINT | {
    ("layers", "post_attn_norm", "scale"): ("model.layers.{i}.post_attention_layernorm.weight", _same),  # [D]
    ("layers", "mlp_norm", "scale"): ("model.layers.{i}.pre_feedforward_layernorm.weight", _same),  # [D]
    ("layers", "post_mlp_norm", "scale"): ("model.layers.{i}.post_feedforward_layernorm.weight", _same),  # [D]
}

TO_HF: dict[Transform, Transform] = {_same: _same}  # each transform above's inverse (llama.py's TO_HF)
