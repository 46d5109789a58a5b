"""Run as a script under fake CPU devices (test_sharding.py starts it with
XLA_FLAGS=--xla_force_host_platform_device_count=4, which must be set before jax starts): the same
requests through the real scheduler core on a tiny random Llama, Qwen3 and Qwen3-MoE (one MoE and one
dense layer; `fused` and `ep`), once without a layout and once per parallelism layout, and on Qwen2 (q, k
and v biases split by head; its layer 1 sliding by 5 tokens), Mistral (every layer sliding by 5) and
Mixtral (`fused`; its experts split too, ep2) alone and under tp2; prints one JSON line per (model, layout): greedy tokens, the max |logit - the first run's|, and
whether the forward step still aliases the donated cache and copies none of it (a shard of one KV head
included: tp4)."""

from __future__ import annotations

import json
from dataclasses import replace

import jax
import numpy as np
from flax import nnx

from jaxstream.config import load_config
from jaxstream.protocol import SamplingParams
from tests.worker.driver import Driver
from tests.worker.hlo_check import full_copies
from worker_svc.batch import Buckets
from worker_svc.engine import Engine
from worker_svc.models.llama import Llama, LlamaConfig
from worker_svc.models.mistral import Mistral, MistralConfig
from worker_svc.models.mixtral import Mixtral, MixtralConfig
from worker_svc.models.qwen2 import Qwen2, Qwen2Config
from worker_svc.models.qwen3 import Qwen3, Qwen3Config
from worker_svc.models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig
from worker_svc.sharding import make_layout

NUMBERS = dict(vocab=128, dim=32, layers=2, heads=8, kv_heads=4, head_dim=8, mlp_dim=64, rope_theta=10000.0,
               norm_eps=1e-5, tie_embeddings=False)
MOE = Qwen3MoeConfig(**NUMBERS, experts=8, top_k=2, moe_mlp_dim=16, norm_topk_prob=True, moe_layers=(0,))
MODELS = {"llama": (Llama, LlamaConfig(**{**NUMBERS, "tie_embeddings": True})), "qwen3": (Qwen3, Qwen3Config(**NUMBERS)),
          "qwen3_moe": (Qwen3Moe, MOE), "qwen3_moe_ep": (Qwen3Moe, replace(MOE, moe="ep")),
          "qwen2": (Qwen2, Qwen2Config(**NUMBERS, windows=(0, 5))), "mistral": (Mistral, MistralConfig(**NUMBERS, windows=(5, 5))),
          "mixtral": (Mixtral, MixtralConfig(**NUMBERS, experts=8, top_k=2))}
# The later families under tp2 (and Mixtral's experts under ep2) only: their layers shard as the earlier ones'
# (a bias as its head).
LAYOUTS = {"llama": ("single", "tp2", "tp4"), "qwen3": ("single", "tp2", "tp4"), "qwen2": ("single", "tp2"),
           "mistral": ("single", "tp2"), "mixtral": ("single", "tp2", "ep2")}
MOE_LAYOUTS = ("single", "tp2", "tp4", "ep2", "tp2_ep2")
PAGE_SIZE, NUM_PAGES = 4, 64
BUCKETS = Buckets(tokens=(16,), pairs=(0, 64), max_rows=8, max_pages=16)  # few shapes: each compiles per layout
REQUESTS = [(f"r{i}", np.random.default_rng(i).integers(0, 128, 3 + 9 * i).tolist(), SamplingParams(temperature=0.0, max_new_tokens=10))
            for i in range(3)]


def cache_copies(hlo: str, shard: tuple[int, ...]) -> int:
    """Copies in compiled HLO of an array of a cache array's shape on one device."""
    return sum(f"[{','.join(map(str, shard))}]" in line for line in full_copies(hlo, int(np.prod(shard))))


def main() -> None:
    for model, (model_cls, cfg) in MODELS.items():
        reference = None
        # None: no layout at all, the reference; a `moe_ep` model's is the `moe` one's (same weights).
        for name in ((None,) if model in ("llama", "qwen3_moe") else ()) + LAYOUTS.get(model, MOE_LAYOUTS):
            parallelism = load_config([f"parallelism={name or 'single'}"]).parallelism
            layout = None if name is None else make_layout(parallelism, jax.devices()[: parallelism.tensor * parallelism.expert])
            if layout is not None and getattr(cfg, "moe", None) == "ep":
                cfg = replace(cfg, shards=layout.expert_shards())
            engine = Engine(model_cls(cfg, rngs=nnx.Rngs(0)), BUCKETS, PAGE_SIZE, NUM_PAGES, layout=layout)
            traces = Driver(engine, PAGE_SIZE, NUM_PAGES, budget=16, max_running=8, keep_logits=True).run(REQUESTS)
            logits = np.concatenate([np.stack(t.logits) for t in traces.values()])
            reference = logits if reference is None else reference
            if model == "qwen3_moe" and name is None:
                moe_reference = logits
            if model == "qwen3_moe_ep" and reference is logits:
                reference = moe_reference  # compare `ep` with `fused` on the same weights
            text = next(iter(engine.executables.forwards.values())).as_text()
            header = text.splitlines()[0]
            shard = engine.cache.k.addressable_shards[0].data.shape  # what one device holds
            print(json.dumps({"model": model, "layout": name, "tokens": {rid: t.tokens for rid, t in traces.items()},
                              "max_diff": float(np.abs(logits - reference).max()), "aliases": header.count("may-alias"),
                              "cache_copies": sum(cache_copies(f.as_text(), shard) for f in engine.executables.forwards.values()),
                              "all_to_all": text.count(" all-to-all("),
                              "cache_spec": str(getattr(engine.cache.k.sharding, "spec", None)), "recompiles": engine.compiles_after_ready}))


if __name__ == "__main__":
    main()
