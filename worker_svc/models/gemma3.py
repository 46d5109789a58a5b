"""Gemma 3 (Gemma Team, 2025), its text decoder: Gemma 2's layer (gemma2.py: the embedding scaled
by sqrt(hidden size), (1 + w) RMSNorms, four norms a layer, the GELU-tanh gated MLP,
query_pre_attn_scalar), with

- QK-norm in place of Gemma 2's attention soft-capping: q and k RMS-normed per head, (1 + w) too;
- five local layers to a global one by default (`layer_types`, or the older configs'
  sliding_window_pattern): a local layer attends the last `sliding_window` positions;
- two rotary bases: the local layers rotate by theirs (rope_parameters' sliding_attention, theta
  10000), the global ones by theirs (full_attention: theta 1e6, with a linear scaling from 4B up,
  factor 8). Both are computed once a step and each layer picks its own by its index inside the
  layer scan (layers/rotary.py's LayerRopes): one compiled layer body for the mixed stack;
- the logits soft-capped only where the config sets final_logit_softcapping (released ones do not).

Not here: attn_logit_softcapping (transformers' Gemma 3 reads it but never applies it, so a config
setting it is refused rather than guessed at), rotary scalings but linear, bidirectional attention,
attention biases, other activations: each refused by name. The multimodal checkpoints
(Gemma3ForConditionalGeneration: 4B, 12B, 27B) are another architecture, not served: this serves
Gemma3ForCausalLM (1B, and any text decoder saved as one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.decoder import Decoder
from worker_svc.layers.rotary import LayerRopes, LinearScaling, Rope
from worker_svc.models import gemma2
from worker_svc.models.gemma2 import Gemma2Config, decoder_options, gemma_numbers, layer_types, refuse_unsupported
from worker_svc.models.llama import Transform
from worker_svc.models.qwen3 import CHECKPOINT as QWEN3_CHECKPOINT

DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # transformers' Gemma3TextConfig
SLIDING_WINDOW_PATTERN = 6  # transformers' default: layers 6, 12, ... (counting from 1) are global


@dataclass(frozen=True)
class Gemma3Config(Gemma2Config):
    """Gemma 2's numbers: rope_theta and rope_scaling are the global layers'; the local layers' their own."""

    local_rope_theta: float = DEFAULT_THETA["sliding_attention"]
    local_rope_scaling: LinearScaling | None = None

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> "Gemma3Config":
        refuse_unsupported("Gemma3", c)
        if c.get("attn_logit_softcapping") is not None:
            raise ValueError("Gemma3 with attn_logit_softcapping set is not supported: transformers' Gemma 3 does not "
                             "apply it (QK-norm replaced it), so the config's meaning is unclear")
        types = layer_types("Gemma3", c, every=c.get("sliding_window_pattern", SLIDING_WINDOW_PATTERN))
        (theta, scaling), (local_theta, local_scaling) = (_rope(c, kind) for kind in ("full_attention", "sliding_attention"))
        return cls(**gemma_numbers("Gemma3", c, types), rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta,
                   local_rope_scaling=local_scaling)


def _rope(c: dict[str, Any], kind: str) -> tuple[float, LinearScaling | None]:
    """One kind of layer's rotary base and scaling: transformers 5's rope_parameters holds one dict per
    kind; older configs give the global layers' as rope_theta and rope_scaling, the local layers'
    base as rope_local_base_freq."""
    nested = c.get("rope_parameters") or {}
    if kind in nested:
        rope = nested[kind] or {}
        theta = rope.get("rope_theta", DEFAULT_THETA[kind])
    elif kind == "full_attention":
        rope, theta = c.get("rope_scaling") or {}, c.get("rope_theta", DEFAULT_THETA[kind])
    else:
        rope, theta = {}, c.get("rope_local_base_freq", DEFAULT_THETA[kind])
    name = rope.get("rope_type", rope.get("type", "default"))
    if name == "default":
        return float(theta), None
    if name == "linear":
        return float(theta), LinearScaling(float(rope["factor"]))
    raise ValueError(f"Gemma3 with rope_type {name!r} on its {kind} layers is not supported (only the default rotary and linear)")


class DecoderLayer(gemma2.DecoderLayer):
    """Gemma 2's layer with QK-norm, rotating by its own kind's rotary."""

    def __init__(self, cfg: Gemma3Config, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        super().__init__(cfg, qk_norm=True, dtype=dtype, rngs=rngs)

    def __call__(self, x, rope: LayerRopes, cache, layer, ctx):
        return super().__call__(x, rope.at(layer), cache, layer, ctx)


class Gemma3(Decoder):
    def __init__(self, cfg: Gemma3Config, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs) -> None:
        super().__init__(cfg, lambda r: DecoderLayer(cfg, dtype=dtype, rngs=r), dtype=dtype, rngs=rngs,
                         **decoder_options(cfg))

    def rotary(self, positions: jax.Array) -> LayerRopes:
        """Both kinds' rotary, global first: a layer with a window is local (kind 1)."""
        cfg = self.cfg
        ropes = (Rope(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
                 Rope(positions, cfg.head_dim, cfg.local_rope_theta, cfg.local_rope_scaling))
        return LayerRopes(ropes, [1 if window else 0 for window in cfg.windows or (0,) * cfg.layers])


# Checkpoint names: Gemma 2's, plus the per-head q and k norms under Qwen3's names (their w as stored).
CHECKPOINT: dict[tuple[str, ...], tuple[str, Transform]] = gemma2.CHECKPOINT | {
    key: QWEN3_CHECKPOINT[key] for key in (("layers", "attn", "q_norm", "scale"), ("layers", "attn", "k_norm", "scale"))}
TO_HF: dict[Transform, Transform] = {}  # Gemma 2's and Qwen3's transforms, whose inverses their files hold
