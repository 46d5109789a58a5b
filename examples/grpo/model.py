"""The trainer's Qwen3-MoE: the served architecture written again for training, over one whole
sequence [S] at a time (no paged cache, no buckets), differentiable end to end.

    h = x + attention(rms_norm(x))          # GQA with per-head q/k RMSNorm and rotary
    out = h + mlp(rms_norm(h))              # MoE on `moe_layers`, dense SwiGLU on the others
    logits = rms_norm(out) @ embed.T        # tied LM head, float32

It has its own parameters, model code, routing replay and loss, and calls the served layer
functions (worker_svc/layers: norms, router, experts, attention, rotary, the checkpoint-name
tables) but never the worker's compiled step: sharing layers is fine; sharing the compiled step is
not. With those functions in their batch-invariant form, the trainer's numbers are the server's to
the bit when the server runs with worker.batch_invariant.

Routing replay: given `routed_experts` [S, L, k] (the experts the server chose per token and layer,
SGLang's R3 export; -1 where there is none to replay: the trainer's own choice), an MoE layer uses those experts
instead of its own top k. Their weights are still the trainer's router softmax, gathered at those
ids (renormalized with norm_topk_prob), so the router gets gradients.

Parameters are a plain dict, float32, in the worker's layouts (q [D, N, H], experts [E, D, F], ...):
    {"embed.table": [V, D], "norm.scale": [D], ("lm_head.w": [D, V] untied only),
     "layers": [{"attn.q": ..., "mlp.router.w": ..., ...} per layer]}
the keys being the worker's parameter paths (worker_svc/models/qwen3_moe.py's CHECKPOINT, less the
stack name), so `to_hf` and `from_hf` are that table and its inverses (TO_HF).

LoRA: `forward(..., lora=Lora(weights, scale))` adds an adapter's delta to the projections it adapts,
as the server's adapter slots do (`project`); lora.py draws, names and pushes one.

Shapes: S tokens, D model, N q heads, K kv heads, G = N / K, H head dim, F mlp, E experts,
k experts per token, L layers, V vocab.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from worker_svc.layers import lora, moe, norms
from worker_svc.layers.attention import KVCache, PagedContext, ordered_attention
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.rotary import Rope
from worker_svc.layers.sampling import log_prob, normalizer
from worker_svc.models import TO_HF
from worker_svc.models.qwen3_moe import CHECKPOINT, Qwen3MoeConfig

Params = dict
Weights = list  # a LoRA adapter's, per layer: {target: (A [Din, r], B [r, Dout])} (Lora, lora.py)


# --- the served layers' arithmetic, shared ---
# The server's worker.batch_invariant mode makes each token's numbers a function of that token
# alone (worker_svc/layers/numerics.py): matmuls and row sums in fixed tiles, attention summed page
# by page in position order. Running the same layer functions over the whole sequence, the
# trainer gets the served logprobs to the bit (0 difference) when the server runs in that mode.

NUMERICS = Numerics(batch_invariant=True)


def dense(x: jax.Array, w: jax.Array, spec: str, **kwargs) -> jax.Array:
    """Every weight matmul: x times a weight by the einsum `spec`, in the served tiles."""
    return NUMERICS.matmul(spec, x, w, **kwargs)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, page_size: int) -> jax.Array:
    """Causal grouped-query attention: q [S, N, H], k and v [S, K, H] -> [S, N, H], summed in the
    served order (the server's scheduler.page_size matters: each page is summed on its own)."""
    ctx = jax.tree.map(jnp.asarray, PagedContext.sequence(q.shape[0], page_size))
    empty = jnp.zeros((1, 1, page_size, *k.shape[1:]), k.dtype)  # nothing cached: every key is this pass's
    return ordered_attention(q, k, v, KVCache(empty, empty), 0, ctx, every_chunk=True)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    return norms.rms_norm(x, scale, eps, NUMERICS)


def route(x: jax.Array, w: jax.Array, cfg: Qwen3MoeConfig, replay: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """x [S, D] -> (routing weights [S, k], chosen experts [S, k] int32): softmax over all E experts
    in float32, then the top k, or the replayed ids [S, k] where they are >= 0 (-1: none given,
    as for the last token, which the server never forwarded)."""
    weights, chosen = moe.route(x, w, cfg.top_k, cfg.norm_topk_prob, NUMERICS, replay)
    return weights, chosen.astype(jnp.int32)


class Lora(NamedTuple):
    """An adapter over the parameters (lora.py makes, names and pushes it): per layer {target: (A [Din, r],
    B [r, Dout])} on the projections it adapts (q, k, v, o; gate, up, down of a dense MLP), and its scale."""

    weights: Weights
    scale: float


def project(p: Mapping, key: str, x: jax.Array, spec: str, adapter: Mapping | None, scale: float) -> jax.Array:
    """The projection p[key] of x, plus the adapter's delta where it adapts it (`adapter`: this layer's
    {target: (A, B)}, target the key's last part), by the served function in its batch-invariant form
    (worker_svc/layers/lora.py: each row through its own slot's A and B, in the mode's row tiles),
    the adapter as slot 0 of one."""
    y = dense(x, p[key], spec)
    target = key.rpartition(".")[2]
    if not adapter or target not in adapter:
        return y
    a, b = adapter[target]
    slot = jnp.zeros((x.shape[0],), jnp.int32)
    out = NUMERICS.rowwise(lambda x, slot: lora.gathered_delta(x, a[None], b[None], jnp.full((1,), scale, jnp.float32), slot),
                           x.reshape(x.shape[0], -1), slot)
    return y + out.reshape(y.shape).astype(y.dtype)


def attn(p: Mapping, x: jax.Array, rope: Rope, cfg: Qwen3MoeConfig, page_size: int, adapter: Mapping | None = None,
         scale: float = 0.0) -> jax.Array:
    """x [S, D] (normed) -> [S, D]: q, k, v, each head's q and k RMS-normed, rotary, attention, o."""
    q = rms_norm(project(p, "attn.q", x, "SD,DNH->SNH", adapter, scale), p["attn.q_norm.scale"], cfg.norm_eps)
    k = rms_norm(project(p, "attn.k", x, "SD,DKH->SKH", adapter, scale), p["attn.k_norm.scale"], cfg.norm_eps)
    v = project(p, "attn.v", x, "SD,DKH->SKH", adapter, scale)
    return project(p, "attn.o", attention(rope(q), rope(k), v, page_size), "SNH,NHD->SD", adapter, scale)


def mlp(p: Mapping, x: jax.Array, cfg: Qwen3MoeConfig, replay: jax.Array | None, adapter: Mapping | None = None,
        scale: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """x [S, D] (normed) -> ([S, D], the chosen experts [S, k], -1 on a dense layer)."""
    if "mlp.router.w" in p:
        weights, chosen = route(x, p["mlp.router.w"], cfg, replay)
        return moe.fused(x, weights, chosen, p["mlp.experts.gate"], p["mlp.experts.up"], p["mlp.experts.down"], NUMERICS), chosen
    gated = jax.nn.silu(project(p, "mlp.gate", x, "SD,DF->SF", adapter, scale)) * project(p, "mlp.up", x, "SD,DF->SF", adapter, scale)
    return project(p, "mlp.down", gated, "SF,FD->SD", adapter, scale), jnp.full((x.shape[0], cfg.top_k), -1, jnp.int32)


def layer(p: Mapping, x: jax.Array, rope: Rope, cfg: Qwen3MoeConfig, replay: jax.Array | None, page_size: int,
          adapter: Mapping | None = None, scale: float = 0.0):
    """One decoder layer: x [S, D] -> (x [S, D], chosen experts [S, k]); `adapter` its LoRA (see project)."""
    h = x + attn(p, rms_norm(x, p["attn_norm.scale"], cfg.norm_eps), rope, cfg, page_size, adapter, scale)
    out, chosen = mlp(p, rms_norm(h, p["mlp_norm.scale"], cfg.norm_eps), cfg, replay, adapter, scale)
    return h + out, chosen


def forward(params: Params, cfg: Qwen3MoeConfig, tokens: jax.Array, routed_experts: jax.Array | None = None,
            page_size: int = 16, lora: Lora | None = None) -> tuple[jax.Array, jax.Array]:
    """tokens [S] -> (logits [S, V] float32, the experts used [S, L, k] int32, -1 on dense layers:
    the export's format, so passing it back replays this pass's routing). `page_size`: the
    server's scheduler.page_size, the blocks attention sums in. `lora`: an adapter over the
    parameters (None: the base model)."""
    rope = Rope(jnp.arange(tokens.shape[0]), cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    x = jnp.take(params["embed.table"], tokens, axis=0)  # [S, D]
    used = []
    for i, p in enumerate(params["layers"]):
        adapter, scale = (None, 0.0) if lora is None else (lora.weights[i], lora.scale)
        x, chosen = layer(p, x, rope, cfg, None if routed_experts is None else routed_experts[:, i], page_size, adapter, scale)
        used.append(chosen)
    h = rms_norm(x, params["norm.scale"], cfg.norm_eps)
    if cfg.tie_embeddings:
        return dense(h, params["embed.table"], "SD,VD->SV", preferred_element_type=jnp.float32), jnp.stack(used, axis=1)
    return dense(h, params["lm_head.w"], "SD,DV->SV", preferred_element_type=jnp.float32), jnp.stack(used, axis=1)


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """The served logprob at temperature 1 (worker_svc/engine.py): log_softmax over the whole
    vocabulary in float32, as the sampler computes it: (x - peak) - log(sum(exp(x - peak)))."""
    def rows(logits, targets):
        t = jnp.ones((logits.shape[0], 1), jnp.float32)
        peak, total = normalizer(logits, t)
        return log_prob(jnp.take_along_axis(logits, targets[:, None], axis=-1), t, peak, jnp.log(total))[:, 0]

    return NUMERICS.rowwise(rows, logits, targets)


# --- parameters: a seeded draw, and the Hugging Face names and layouts ---


def layer_shapes(cfg: Qwen3MoeConfig, moe: bool) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """Each layer parameter's shape and fan-in (None: a norm scale, ones)."""
    d, n, kv, h = cfg.dim, cfg.heads, cfg.kv_heads, cfg.head_dim
    shapes = {"attn_norm.scale": ((d,), None), "attn.q": ((d, n, h), d), "attn.k": ((d, kv, h), d), "attn.v": ((d, kv, h), d),
              "attn.o": ((n, h, d), n * h), "attn.q_norm.scale": ((h,), None), "attn.k_norm.scale": ((h,), None),
              "mlp_norm.scale": ((d,), None)}
    if moe:
        e, f = cfg.experts, cfg.moe_mlp_dim
        return shapes | {"mlp.router.w": ((d, e), d), "mlp.experts.gate": ((e, d, f), d), "mlp.experts.up": ((e, d, f), d),
                         "mlp.experts.down": ((e, f, d), f)}
    f = cfg.mlp_dim
    return shapes | {"mlp.gate": ((d, f), d), "mlp.up": ((d, f), d), "mlp.down": ((f, d), f)}


def init_params(cfg: Qwen3MoeConfig, seed: int, embed_std: float = 0.02) -> Params:
    """Random weights as the worker draws its dummy ones: normal / sqrt(fan-in), the embedding
    normal * embed_std, norm scales 1."""
    keys = iter(jax.random.split(jax.random.key(seed), 1 + 16 * cfg.layers))

    def draw(shape, fan_in):
        if fan_in is None:
            return jnp.ones(shape, jnp.float32)
        return jax.random.normal(next(keys), shape, jnp.float32) * fan_in**-0.5

    params = {"embed.table": jax.random.normal(next(keys), (cfg.vocab, cfg.dim), jnp.float32) * embed_std,
              "norm.scale": jnp.ones((cfg.dim,), jnp.float32),
              "layers": [{key: draw(*spec) for key, spec in layer_shapes(cfg, i in cfg.moe_layers).items()}
                         for i in range(cfg.layers)]}
    if not cfg.tie_embeddings:
        params["lm_head.w"] = draw((cfg.dim, cfg.vocab), cfg.dim)
    return params


def table(cfg: Qwen3MoeConfig, i: int) -> dict[str, tuple]:
    """Layer i's rows of the worker's CHECKPOINT table: our key -> (HF name pattern, HF -> ours)."""
    stack = "moe_layers" if i in cfg.moe_layers else "dense_layers"
    return {".".join(path[1:]): entry for path, entry in CHECKPOINT.items() if path[0] == stack}


def _top(cfg: Qwen3MoeConfig) -> dict[str, tuple]:
    top = {".".join(path): entry for path, entry in CHECKPOINT.items() if "layers" not in path[0]}
    return top if not cfg.tie_embeddings else {key: entry for key, entry in top.items() if key != "lm_head.w"}


def to_hf(params: Params, cfg: Qwen3MoeConfig) -> dict[str, np.ndarray]:
    """Our parameters -> {Hugging Face tensor name: float32 array in the checkpoint's layout}:
    what /list_weights lists and a push names."""
    out = {}
    for key, (name, transform) in _top(cfg).items():
        out[name] = np.ascontiguousarray(TO_HF[transform](np.asarray(params[key]), cfg))
    for i, p in enumerate(params["layers"]):
        for key, (name, transform) in table(cfg, i).items():
            w = np.asarray(p[key])
            for j in range(w.shape[0]) if "{j}" in name else [None]:  # one tensor per expert
                out[name.format(i=i, j=j)] = np.ascontiguousarray(TO_HF[transform](w if j is None else w[j], cfg))
    return out


def from_hf(tensors: Mapping[str, np.ndarray], cfg: Qwen3MoeConfig) -> Params:
    """The inverse of `to_hf`."""
    params = {key: jnp.asarray(transform(np.asarray(tensors[name]), cfg)) for key, (name, transform) in _top(cfg).items()}
    params["layers"] = []
    for i in range(cfg.layers):
        layer_params = {}
        for key, (name, transform) in table(cfg, i).items():
            if "{j}" in name:
                experts = [transform(np.asarray(tensors[name.format(i=i, j=j)]), cfg) for j in range(cfg.experts)]
                layer_params[key] = jnp.stack(experts)
            else:
                layer_params[key] = jnp.asarray(transform(np.asarray(tensors[name.format(i=i)]), cfg))
        params["layers"].append(layer_params)
    return params
