"""DeepSeek's mixture of experts (DeepSeekMoE, Dai et al., 2024; DeepSeek-V2 and V3), as DeepSeek-V2
and V3, Kimi K2 and Moonlight use it: each token's top k of E routed experts, weighted, as in
layers/moe.py (its `Experts`, under the same `fused` and `ep` strategies), plus `shared_experts`
experts every token goes through, one SwiGLU of moe_mlp_dim x shared_experts, added unweighted.

What differs is the router, which follows transformers' DeepseekV3TopkRouter and DeepseekV2TopkRouter:

- Scores from the logits in float32: their `sigmoid` (V3), or their `softmax` over all E (V2).
- The choice, `topk_method`:
  - `noaux_tc` (V3): a correction bias [E] (e_score_correction_bias, which DeepSeek's auxiliary-loss-free
    load balancing moves between training steps) is added to the scores for the choice only. The E
    experts are n_group groups of E / n_group; a group's score is the sum of its two best biased
    scores; the topk_group best groups are kept and the top k of their experts chosen.
  - `group_limited_greedy` (V2): the same groups, each scored by its best score, no bias.
  - `greedy` (V2): the top k of all E.
- The weights: the chosen experts' scores (without the bias), renormalized to sum to 1 under
  `norm_topk_prob` (over their sum + 1e-20, as transformers), then times `routed_scaling_factor`.
  transformers' DeepseekV2TopkRouter never renormalizes (it reads no norm_topk_prob); DeepSeek's own
  V2 code, given it, renormalizes and then does not scale. A V2 model matching transformers passes False.

The chosen experts come best first by the score they were chosen on, ties to the lower index (torch.topk's
sorted order). transformers asks torch.topk for sorted=False, whose order on CPU is its selection
algorithm's (std::nth_element), so the same experts may come in another order there: compare each
token's set. The order changes no output but the last bits of the weighted sum.

Routing runs as Router's (layers/moe.py's in_router_numerics): float32 scores and weights; under
router_fp32 the matmul from float32 inputs and weights, and the weights kept float32 into the experts'
sum; row-wise (Numerics.rowwise) under batch_invariant. The router and its bias are never quantized.

Shapes in the legend of worker_svc/__init__.py: here k experts per token, G groups of E / G experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from worker_svc.layers.mlp import SwiGLU
from worker_svc.layers.moe import Experts, ExpertShards, Routed, check_strategy, in_router_numerics, through_experts
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.quantized import weight

SCORINGS = ("sigmoid", "softmax")
TOPK_METHODS = ("noaux_tc", "group_limited_greedy", "greedy")


@dataclass(frozen=True)
class Routing:
    """The router's rule (the module docstring): refused, naming the field, where it cannot choose k experts."""

    experts: int  # E
    top_k: int  # k
    scoring: str  # one of SCORINGS
    topk_method: str  # one of TOPK_METHODS
    n_group: int  # G (read by the group-limited methods)
    topk_group: int  # groups kept
    norm_topk_prob: bool
    routed_scaling_factor: float

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"DeepSeek MoE scoring_func must be one of {SCORINGS}, got {self.scoring!r}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"DeepSeek MoE topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if not 0 < self.top_k <= self.experts:
            raise ValueError(f"DeepSeek MoE num_experts_per_tok {self.top_k} of n_routed_experts {self.experts} is not supported")
        if self.topk_method == "greedy":
            return
        if not self.n_group or self.experts % self.n_group:
            raise ValueError(f"DeepSeek MoE n_group {self.n_group} does not divide n_routed_experts {self.experts}")
        if self.topk_method == "noaux_tc" and self.experts // self.n_group < 2:  # a group is scored by its two best
            raise ValueError(f"DeepSeek MoE n_group {self.n_group} leaves fewer than 2 of n_routed_experts {self.experts} "
                             "per group, which noaux_tc scores by their two best")
        if not 0 < self.topk_group <= self.n_group or self.topk_group * (self.experts // self.n_group) < self.top_k:
            raise ValueError(f"DeepSeek MoE topk_group {self.topk_group} of n_group {self.n_group} keeps fewer than "
                             f"num_experts_per_tok {self.top_k} of n_routed_experts {self.experts}")


def route(x: jax.Array, w: jax.Array, correction: jax.Array | None, rule: Routing, numerics: Numerics = Numerics(),
          replay: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x [T, D], router w [D, E] and its correction bias [E] (noaux_tc's) -> (weights [T, k] f32,
    chosen [T, k] i32), row-wise. `replay` [T, k] (a trainer's, from the served routed experts), as
    layers/moe.route's: these experts instead of the choice where >= 0, weighted from the same scores."""

    def rows_route(rows: jax.Array, replayed: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        logits = jnp.einsum("TD,DE->TE", rows, w, preferred_element_type=jnp.float32)
        scores = jax.nn.sigmoid(logits) if rule.scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)  # [T, E] f32
        chosen = choose(scores, correction, rule)
        if replayed is not None:
            chosen = jnp.where(replayed >= 0, replayed, chosen)
        weights = jnp.take_along_axis(scores, chosen, axis=-1)  # [T, k], the unbiased scores
        if rule.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return weights * rule.routed_scaling_factor, chosen

    return numerics.rowwise(rows_route, x, replay)


def choose(scores: jax.Array, correction: jax.Array | None, rule: Routing) -> jax.Array:
    """Scores [T, E] f32 -> each token's k experts [T, k] i32, best first. jax.lax.top_k's ties go to
    the lower index, as torch.topk's do."""
    if rule.topk_method == "greedy":
        return jax.lax.top_k(scores, rule.top_k)[1]
    biased = scores if correction is None else scores + correction.astype(jnp.float32)  # [T, E]
    grouped = biased.reshape(biased.shape[0], rule.n_group, -1)  # [T, G, E / G]
    if rule.topk_method == "noaux_tc":
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]: each group's two best
    else:
        group_scores = grouped.max(-1)  # [T, G]
    kept = jax.lax.top_k(group_scores, rule.topk_group)[1]  # [T, topk_group]
    in_kept = jax.nn.one_hot(kept, rule.n_group, dtype=jnp.int32).sum(1) > 0  # [T, G]
    # Experts of the other groups can never be chosen: V3 masks them with -inf, V2 with 0 (below every
    # softmax score); the rule keeps at least k others (Routing).
    masked = jnp.where(in_kept[:, :, None], grouped, -jnp.inf if rule.topk_method == "noaux_tc" else 0.0)
    return jax.lax.top_k(masked.reshape(biased.shape), rule.top_k)[1]


class DeepseekRouter(nnx.Module):
    """w [D, E], and under noaux_tc the correction bias [E], float32 whatever the model's dtype (as
    checkpoints hold it: it decides the choice, to differences below bfloat16's precision)."""

    def __init__(self, dim: int, rule: Routing, *, numerics: Numerics, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.w = weight(rngs, (dim, rule.experts), dim**-0.5, ("embed", "expert"), (0,), dtype, None)  # [D, E]
        self.correction = (nnx.Param(jnp.zeros((rule.experts,), jnp.float32), out_sharding=("expert",), eager_sharding=False)
                           if rule.topk_method == "noaux_tc" else None)  # [E], a stand-in (loading.py fills it)
        self.rule = rule
        self.numerics = numerics

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [T, D] -> (weights [T, k] in x's dtype (float32 under router_fp32), chosen experts [T, k] i32)."""
        correction = None if self.correction is None else self.correction[...]
        return in_router_numerics(x, self.w[...], self.numerics, lambda x, w: route(x, w, correction, self.rule, self.numerics))


class DeepseekMoE(nnx.Module):
    """x [T, D] -> [T, D]: the routed experts' weighted sum (strategy "fused" or "ep", `shards` for
    `ep` on several devices: layers/moe.py), plus the shared experts' SwiGLU (none when 0). Sows the
    chosen experts [T, k] (moe.Routed), as MoE does."""

    def __init__(self, dim: int, moe_mlp_dim: int, experts: int, top_k: int, *, shared_experts: int, scoring: str,
                 topk_method: str, n_group: int, topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
                 strategy: str, numerics: Numerics = Numerics(), dtype: jnp.dtype, rngs: nnx.Rngs,
                 shards: ExpertShards | None = None) -> None:
        check_strategy(strategy, numerics)
        rule = Routing(experts, top_k, scoring, topk_method, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
        self.router = DeepseekRouter(dim, rule, numerics=numerics, dtype=dtype, rngs=rngs)
        self.experts = Experts(dim, moe_mlp_dim, experts, numerics=numerics, dtype=dtype, rngs=rngs)
        self.shared = (SwiGLU(dim, moe_mlp_dim * shared_experts, numerics=numerics, dtype=dtype, rngs=rngs)
                       if shared_experts else None)
        self.strategy = strategy
        self.shards = shards

    def __call__(self, x: jax.Array) -> jax.Array:
        weights, chosen = self.router(x)  # [T, k], [T, k]
        self.sow(Routed, "chosen", chosen)
        # float32 routing weights (router_fp32) weighted the sum in float32
        out = through_experts(self.experts, x, weights, chosen, self.strategy, self.shards).astype(x.dtype)
        return out if self.shared is None else out + self.shared(x)


# ---------------------------------------------------------------------------------------------
# Checkpoint names, relative to the decoder layer ({i}: the checkpoint's layer, {j}: the expert), as
# DeepSeek's checkpoints hold them and transformers 5's save_pretrained writes them (it fuses each
# expert's gate and up in memory only): one Linear [out, in] per expert and matrix; the correction
# bias under the router (`gate`), float32.

Transform = Callable[[np.ndarray, Any], np.ndarray]


def _linear(w, cfg):  # HF Linear [out, in] -> [in, out]
    return w.T


def _same(w, cfg):
    return w


MOE_CHECKPOINT: dict[tuple[str, ...], tuple[str, Transform]] = {
    ("mlp", "router", "w"): ("model.layers.{i}.mlp.gate.weight", _linear),  # [E, D] -> [D, E]
    ("mlp", "router", "correction"): ("model.layers.{i}.mlp.gate.e_score_correction_bias", _same),  # [E]
    ("mlp", "experts", "gate"): ("model.layers.{i}.mlp.experts.{j}.gate_proj.weight", _linear),  # [F, D] -> [D, F]
    ("mlp", "experts", "up"): ("model.layers.{i}.mlp.experts.{j}.up_proj.weight", _linear),  # [F, D] -> [D, F]
    ("mlp", "experts", "down"): ("model.layers.{i}.mlp.experts.{j}.down_proj.weight", _linear),  # [D, F] -> [F, D]
    # One SwiGLU of F = moe_mlp_dim x shared_experts: gate and up [F, D] -> [D, F], down [D, F] -> [F, D].
    **{("mlp", "shared", name): (f"model.layers.{{i}}.mlp.shared_experts.{name}_proj.weight", _linear)
       for name in ("gate", "up", "down")},
}

TO_HF: dict[Transform, Transform] = {_linear: _linear, _same: _same}  # each transform above's inverse
