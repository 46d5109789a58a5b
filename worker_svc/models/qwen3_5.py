"""Qwen3.5 (Qwen Team, 2026), the dense text model: a hybrid of Gated DeltaNet linear-attention
layers (layers/delta_net.py) and gated full-attention layers, in the order of the config's
`layer_types` (released: three linear, then one full). Every layer has a SwiGLU MLP; every RMSNorm
but the linear layers' output norm scales by (1 + w), as Gemma's.

The full-attention layer is Qwen3's (QK-norm, grouped-query attention over the paged cache) with
two changes: q_proj yields per head a query and an output gate, the output multiplied by
sigmoid(gate) before o_proj; and rotary turns only the first `partial_rotary_factor` of each
head's dimensions (Qwen3.5's mrope sections coincide for text, whose three position ids are equal).

The two kinds are two stacks scanned as one through layers/decoder.py's switch (the layer pattern
as data: each layer's stack and row), so a step is one compiled body whatever the pattern. Only
the full-attention layers hold pages (`cache_spec`'s paged_layers): the paged arrays have a row
per full layer, which a full layer reads by its own row (`GatedAttention.rows`); a linear layer
returns zero entries, which the decoder drops before the step writes the cache.

Not here: a config with attention biases, another activation or rotary scaling is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxstream.architectures import layer_types

from worker_svc.layers.attention import Attention, paged_attention
from worker_svc.layers.decoder import Decoder
from worker_svc.layers.delta_net import GatedDeltaNet, delta_states
from worker_svc.layers.lora import adapted
from worker_svc.layers.mlp import SwiGLU, feed_forward
from worker_svc.layers.norms import RMSNorm
from worker_svc.layers.ordered_attention import ordered_attention
from worker_svc.layers.paged import CacheSpec, rows_among
from worker_svc.layers.quantized import weight
from worker_svc.layers.rotary import Rope
from worker_svc.models.llama import CHECKPOINT as LLAMA_CHECKPOINT
from worker_svc.models.llama import LlamaConfig, Transform


@dataclass(frozen=True)
class Qwen3_5Config(LlamaConfig):
    """Llama's numbers (for the full-attention layers), plus the layer pattern and the linear layers'."""

    linear: tuple[bool, ...] = ()  # per layer: a linear-attention layer (else full attention)
    rotary_dim: int = 0  # the head dimensions rotary turns (the first ones)
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    conv_width: int = 0
    fused_projections: bool = False  # Qwen3-Next's in_proj_qkvz and in_proj_ba (layers/delta_net.py)
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is a mixture of experts (qwen3_5_moe.py); none here

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> "Qwen3_5Config":
        c = c.get("text_config") or c
        if c.get("attention_bias"):
            raise ValueError("Qwen3.5 with attention_bias true is not supported (biases are not implemented)")
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"Qwen3.5 with rope_type {rope.get('rope_type')!r} is not supported (only the default rotary)")
        plain = {k: v for k, v in c.items() if k not in ("rope_parameters", "rope_scaling")}
        base = LlamaConfig.from_hf.__func__(cls, {**plain, "rope_theta": rope.get("rope_theta", c.get("rope_theta", 1e7))})
        types = layer_types(c)  # the foundation's reading (the KV memory figure reads it too)
        if len(types) != base.layers or set(types) - {"linear_attention", "full_attention"}:
            raise ValueError(f"Qwen3.5's layer_types must name linear_attention or full_attention for each of its "
                             f"{base.layers} layers, got {types}")
        return replace(base, linear=tuple(t == "linear_attention" for t in types),
                       rotary_dim=int(base.head_dim * float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))),
                       linear_key_heads=c["linear_num_key_heads"], linear_value_heads=c["linear_num_value_heads"],
                       linear_key_dim=c["linear_key_head_dim"], linear_value_dim=c["linear_value_head_dim"],
                       conv_width=c["linear_conv_kernel_dim"])

    @property
    def full_rows(self) -> tuple[int, ...]:
        """Each layer's row in the paged cache, which only the full-attention layers hold (-1 for a linear one)."""
        return rows_among(tuple(not lin for lin in self.linear))


class GatedAttention(Attention):
    """Qwen3's attention with an output gate per head and rotary over the first dimensions alone."""

    def __init__(self, cfg: Qwen3_5Config, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        super().__init__(cfg.dim, cfg.heads, cfg.kv_heads, cfg.head_dim, qk_norm_eps=cfg.norm_eps, qk_norm_offset=1.0,
                         numerics=cfg.numerics, dtype=dtype, rngs=rngs)
        # [D, N, 2H]: per head the query's H columns, then its output gate's (q_proj's own layout)
        self.q = weight(rngs, (cfg.dim, cfg.heads, 2 * cfg.head_dim), cfg.dim**-0.5, ("embed", "heads", "head_dim"), (0,), dtype,
                        cfg.numerics.quantization)
        self.rotary_dim, self.head_dim = cfg.rotary_dim, cfg.head_dim
        self.rows = cfg.full_rows  # static: the layer index -> this layer's row of the paged cache

    def __call__(self, x, rope, cache, layer, ctx):  # x [T, D] -> (output [T, D], k and v [T, K, H])
        matmul = self.numerics.matmul
        q = adapted(ctx.lora, "q", layer, x, matmul("TD,DNH->TNH", x, self.q[...]), self.numerics)
        q, gate = q[..., :self.head_dim], q[..., self.head_dim:]
        k = adapted(ctx.lora, "k", layer, x, matmul("TD,DKH->TKH", x, self.k[...]), self.numerics)
        v = adapted(ctx.lora, "v", layer, x, matmul("TD,DKH->TKH", x, self.v[...]), self.numerics)
        q, k = self.q_norm(q), self.k_norm(k)
        d = self.rotary_dim
        q = jnp.concatenate([rope(q[..., :d]), q[..., d:]], axis=-1)
        k = jnp.concatenate([rope(k[..., :d]), k[..., d:]], axis=-1)
        row = jnp.asarray(self.rows, jnp.int32)[layer]  # the pages hold the full layers alone
        if self.numerics.batch_invariant:
            out = ordered_attention(q, k, v, cache, row, ctx)
        else:
            out = paged_attention(q, k, v, cache, row, ctx, kernels=self.numerics.kernels)
        out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
        return adapted(ctx.lora, "o", layer, out, matmul("TNH,NHD->TD", out, self.o[...]), self.numerics), k, v


class HybridLayer(nnx.Module):
    """One layer of either kind: pre-norm token mixer, then pre-norm SwiGLU, both residual. Returns
    (x, its keys and values (zeros for a linear layer, dropped by the decoder: no page holds them),
    the step rows' states (layers/states.py): a linear layer's end states, a full layer's start
    states unchanged)."""

    def __init__(self, cfg: Qwen3_5Config, linear: bool, moe: bool = False, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, offset=1.0, numerics=cfg.numerics, dtype=dtype)
        if linear:
            self.attn = GatedDeltaNet(cfg.dim, cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim,
                                      cfg.linear_value_dim, cfg.conv_width, cfg.norm_eps,
                                      fused=cfg.fused_projections, numerics=cfg.numerics, dtype=dtype, rngs=rngs)
        else:
            self.attn = GatedAttention(cfg, dtype=dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, offset=1.0, numerics=cfg.numerics, dtype=dtype)
        self.mlp = self.make_mlp(cfg, moe, dtype, rngs)

    def make_mlp(self, cfg: Qwen3_5Config, moe: bool, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
        """The layer's MLP: SwiGLU (a mixture-of-experts model's file overrides it for its `moe` layers)."""
        return SwiGLU(cfg.dim, cfg.mlp_dim, numerics=cfg.numerics, dtype=dtype, rngs=rngs)

    def __call__(self, x, rope, cache, layer, ctx):
        h = self.attn_norm(x)
        if isinstance(self.attn, GatedDeltaNet):
            a, conv, state = self.attn(h, cache, layer, ctx)
            k = v = jnp.zeros((x.shape[0], self.cfg.kv_heads, self.cfg.head_dim), x.dtype)
        else:
            (a, k, v), conv, state = self.attn(h, rope, cache, layer, ctx), cache.conv, cache.state
        h = x + a
        return h + feed_forward(self.mlp, self.mlp_norm(h), ctx.lora, layer), k, v, conv, state


def stack_name(linear: bool, moe: bool) -> str:
    """The stack of the layers of one kind: `linear_layers`, `full_layers`, `linear_moe_layers`, `full_moe_layers`."""
    return f"{'linear' if linear else 'full'}_{'moe_' if moe else ''}layers"


class Qwen3_5(Decoder):
    """A stack per kind of layer present (`stack_name`: linear or full attention, dense or MoE MLP),
    by the config's layer pattern."""

    layer = HybridLayer

    def __init__(self, cfg: Qwen3_5Config, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs) -> None:
        stacks = {}
        for linear in (True, False):
            for moe in (False, True):
                ids = tuple(i for i, lin in enumerate(cfg.linear) if lin == linear and (i in cfg.moe_layers) == moe)
                if ids:
                    stacks[stack_name(linear, moe)] = (lambda r, linear=linear, moe=moe: self.layer(cfg, linear, moe, dtype=dtype, rngs=r), ids)
        super().__init__(cfg, stacks, dtype=dtype, rngs=rngs, norm_offset=1.0)

    def cache_spec(self) -> CacheSpec:
        cfg = self.cfg
        states = delta_states(sum(cfg.linear), cfg.conv_width, cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim,
                              cfg.linear_value_dim)
        full = tuple(i for i, lin in enumerate(cfg.linear) if not lin)
        return CacheSpec.standard(cfg.kv_heads, cfg.head_dim).with_states(*states, paged_layers=full)

    def rotary(self, positions: jax.Array) -> Rope:
        return Rope(positions, self.cfg.rotary_dim, self.cfg.rope_theta, None)


# ---------------------------------------------------------------------------------------------
# Checkpoint names: Llama's for the MLP, norms, k, v and o; q_proj [N * 2H, D] holds per head the
# query's H rows then the gate's, read as one weight [D, N, 2H]; the linear layers' own, regrouped by
# head where tensor parallelism needs it (layers/delta_net.py).


def _same(w, cfg):
    return w


def _linear(w, cfg):  # HF Linear [out, in] -> [in, out]
    return w.T


def _q_gate(w, cfg):  # [N * 2H, D] -> [D, N, 2H]
    return w.reshape(cfg.heads, 2 * cfg.head_dim, cfg.dim).transpose(2, 0, 1)


def _q_gate_to_hf(w, cfg):  # [D, N, 2H] -> [N * 2H, D]
    return w.transpose(1, 2, 0).reshape(2 * cfg.heads * cfg.head_dim, cfg.dim)


def _grouping(cfg) -> np.ndarray:
    """The convolution channels regrouped by key head: entry c of our order [Nk, G] (a head's query,
    key, then its r value heads' values) is channel _grouping(cfg)[c] of the checkpoint's order (all
    queries, all keys, all values). Indexing, not concatenation: the same on numpy and on jax.eval_shape."""
    Nk, Dk, Dv, r = cfg.linear_key_heads, cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_value_heads // cfg.linear_key_heads
    head = np.arange(Nk)[:, None]
    q, k = head * Dk + np.arange(Dk), Nk * Dk + head * Dk + np.arange(Dk)
    v = 2 * Nk * Dk + head * r * Dv + np.arange(r * Dv)
    return np.concatenate([q, k, v], axis=1).reshape(-1)


def _qkv(w, cfg):  # in_proj_qkv [C, D] -> [D, Nk, G]
    return w[_grouping(cfg)].reshape(cfg.linear_key_heads, -1, cfg.dim).transpose(2, 0, 1)


def _qkv_to_hf(w, cfg):
    return w.transpose(1, 2, 0).reshape(-1, cfg.dim)[np.argsort(_grouping(cfg))]


def _conv(w, cfg):  # [C, 1, W] -> [W, Nk, G]
    return w[_grouping(cfg), 0, :].reshape(cfg.linear_key_heads, -1, w.shape[-1]).transpose(2, 0, 1)


def _conv_to_hf(w, cfg):
    return w.transpose(1, 2, 0).reshape(-1, w.shape[0])[np.argsort(_grouping(cfg))][:, None, :]


def _by_value_head(w, cfg):  # in_proj_z [N * Dv, D] -> [D, N, Dv]
    return w.T.reshape(cfg.dim, cfg.linear_value_heads, -1)


def _by_value_head_to_hf(w, cfg):
    return w.reshape(cfg.dim, -1).T


def _out(w, cfg):  # out_proj [D, N * Dv] -> [N, Dv, D]
    return w.T.reshape(cfg.linear_value_heads, -1, cfg.dim)


def _out_to_hf(w, cfg):
    return w.reshape(-1, cfg.dim).T


_NORMS = {key[1:]: value for key, value in LLAMA_CHECKPOINT.items() if key[0] == "layers" and key[1] in ("attn_norm", "mlp_norm")}
DENSE_MLP = {key[1:]: value for key, value in LLAMA_CHECKPOINT.items() if key[:2] == ("layers", "mlp")}
_ATTENTION = {key[1:]: value for key, value in LLAMA_CHECKPOINT.items() if key[:2] == ("layers", "attn") and key[2] != "q"}
LINEAR = {
    ("attn", "qkv"): ("model.layers.{i}.linear_attn.in_proj_qkv.weight", _qkv),
    ("attn", "z"): ("model.layers.{i}.linear_attn.in_proj_z.weight", _by_value_head),
    ("attn", "b"): ("model.layers.{i}.linear_attn.in_proj_b.weight", _linear),
    ("attn", "a"): ("model.layers.{i}.linear_attn.in_proj_a.weight", _linear),
    ("attn", "conv"): ("model.layers.{i}.linear_attn.conv1d.weight", _conv),
    ("attn", "dt_bias"): ("model.layers.{i}.linear_attn.dt_bias", _same),
    ("attn", "A_log"): ("model.layers.{i}.linear_attn.A_log", _same),
    ("attn", "norm"): ("model.layers.{i}.linear_attn.norm.weight", _same),
    ("attn", "out"): ("model.layers.{i}.linear_attn.out_proj.weight", _out),
}
_FULL = _ATTENTION | {
    ("attn", "q"): ("model.layers.{i}.self_attn.q_proj.weight", _q_gate),
    ("attn", "q_norm", "scale"): ("model.layers.{i}.self_attn.q_norm.weight", _same),
    ("attn", "k_norm", "scale"): ("model.layers.{i}.self_attn.k_norm.weight", _same),
}
_SHARED = {key: value for key, value in LLAMA_CHECKPOINT.items() if key[0] != "layers"}


def checkpoint(linear: dict, mlp: dict | None, moe_mlp: dict | None = None) -> dict[tuple[str, ...], tuple[str, Transform]]:
    """The mapping of every stack (`stack_name`) from the linear layers' own names, the dense MLP's
    and a MoE MLP's (None: no such stacks); the norms' and full attention's are every model's."""
    mapping = dict(_SHARED)
    for moe, names in ((False, mlp), (True, moe_mlp)):
        if names is not None:
            mapping |= {(stack_name(True, moe), *key): value for key, value in (names | _NORMS | linear).items()}
            mapping |= {(stack_name(False, moe), *key): value for key, value in (names | _NORMS | _FULL).items()}
    return mapping


CHECKPOINT = checkpoint(LINEAR, DENSE_MLP)

TO_HF: dict[Transform, Transform] = {_same: _same, _linear: _linear, _q_gate: _q_gate_to_hf, _qkv: _qkv_to_hf, _conv: _conv_to_hf,
                                     _by_value_head: _by_value_head_to_hf, _out: _out_to_hf}  # inverses
