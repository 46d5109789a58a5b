"""The trainer's LoRA (Hu et al., 2021) over its frozen Qwen3-MoE (model.py): the adapter it trains and
pushes, with PEFT's conventions, so that what it pushes is served as the same function.

Each adapted projection W (of x [S, Din], flattened) becomes

    y = x @ W + (x @ A) @ B * scale        A [Din, r], B [r, Dout], scale = alpha / r (rsLoRA: alpha / sqrt(r))

PEFT's init: A uniform in +-1/sqrt(Din) (its kaiming_uniform(a=sqrt(5)) on lora_A [r, Din]), B zero,
so the first adapter is the base model itself. The served delta (worker_svc/layers/lora.py) is the
same arithmetic: x @ A in float32, cast to x's dtype, @ B, times the scale, cast and added to y.

Which projections: `targets`, our names (q, k, v, o of attention; gate, up, down of a dense MLP,
adapted on the dense layers only: experts never, as the server refuses them). A projection's output
(and o's input) flattens head by head, as Hugging Face's rows do (worker_svc/adapters.py), so the
push names A and B by PEFT's names, transposed: `base_model.model.<weight name>.lora_A.weight` [r, Din]
and `.lora_B.weight` [Dout, r].
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from examples.grpo import model
from examples.grpo.model import Weights
from worker_svc.models.qwen3_moe import Qwen3MoeConfig

ATTENTION = ("q", "k", "v", "o")  # what a Qwen3-MoE adapts on every layer
PEFT_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
PREFIX = "base_model.model."  # PEFT's name of the wrapped model

def scale(rank: int, alpha: float, rslora: bool = False) -> float:
    """PEFT's scaling (LoraLayer.update_layer): alpha / r, or alpha / sqrt(r) with use_rslora."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def keys(cfg: Qwen3MoeConfig, i: int, targets: tuple[str, ...]) -> dict[str, str]:
    """Layer i's adapted projections: target -> its weight's key in model.py's layer parameters
    ("attn.q", "mlp.gate", ...). An MLP target only on a dense layer (a MoE layer's MLP is experts)."""
    names = {"q": "attn.q", "k": "attn.k", "v": "attn.v", "o": "attn.o", "gate": "mlp.gate", "up": "mlp.up", "down": "mlp.down"}
    unknown = [t for t in targets if t not in names]
    if unknown:
        raise ValueError(f"LoRA target {unknown[0]!r} is not one of {list(names)}")
    dense = i not in cfg.moe_layers
    return {t: names[t] for t in targets if t in ATTENTION or dense}


def shapes(cfg: Qwen3MoeConfig, i: int, targets: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Layer i's adapted projections: target -> (Din, Dout), the weight's shape flattened."""
    layer = model.layer_shapes(cfg, i in cfg.moe_layers)
    out = {}
    for target, key in keys(cfg, i, targets).items():
        shape = layer[key][0]
        into = shape[0] * shape[1] if target == "o" else shape[0]  # o [N, H, D] takes N*H; the others [D, ...] take D
        out[target] = (into, int(np.prod(shape)) // into)
    return out


def init(cfg: Qwen3MoeConfig, rank: int, targets: tuple[str, ...], seed: int) -> Weights:
    """PEFT's initial adapter: A uniform in +-1/sqrt(Din), B zero (the base model, to the bit)."""
    key = jax.random.key(seed)
    weights = []
    for i in range(cfg.layers):
        layer = {}
        for target, (into, out) in shapes(cfg, i, targets).items():
            key, draw = jax.random.split(key)
            bound = into**-0.5
            layer[target] = (jax.random.uniform(draw, (into, rank), jnp.float32, -bound, bound), jnp.zeros((rank, out), jnp.float32))
        weights.append(layer)
    return weights


def to_peft(weights: Weights, cfg: Qwen3MoeConfig) -> dict[str, np.ndarray]:
    """The adapter by PEFT's names and layouts ([r, Din] and [Dout, r]), float32: what a push names and
    what adapter_model.safetensors holds."""
    out = {}
    for i, layer in enumerate(weights):
        table = model.table(cfg, i)
        for target, (a, b) in layer.items():
            base = PREFIX + table[keys(cfg, i, (target,))[target]][0].format(i=i).removesuffix(".weight")
            out[f"{base}.lora_A.weight"] = np.ascontiguousarray(np.asarray(a).T)
            out[f"{base}.lora_B.weight"] = np.ascontiguousarray(np.asarray(b).T)
    return out


def peft_config(rank: int, alpha: float, targets: tuple[str, ...], base: str | None = None) -> dict:
    """adapter_config.json's fields the server reads (worker_svc/adapters.py's read_peft)."""
    return {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": [PEFT_MODULES[t] for t in targets],
            "use_rslora": False, "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": base}

