"""Run as a script under fake CPU devices (test_sharding.py starts it with
XLA_FLAGS=--xla_force_host_platform_device_count=4, which must be set before jax starts): the same
requests through the real scheduler core on a tiny random Llama and Qwen3, once without a layout and
once per parallelism layout; prints one JSON line per (model, layout): greedy tokens, the max |logit - the first run's|, and
whether the forward step still aliases the donated cache."""

from __future__ import annotations

import json

import jax
import numpy as np
from flax import nnx

from jaxstream.config import load_config
from jaxstream.protocol import SamplingParams
from tests.worker.driver import Driver
from worker_svc.batch import Buckets
from worker_svc.engine import Engine
from worker_svc.models.llama import Llama, LlamaConfig
from worker_svc.models.qwen3 import Qwen3, Qwen3Config
from worker_svc.sharding import make_layout

NUMBERS = dict(vocab=128, dim=32, layers=2, heads=8, kv_heads=4, head_dim=8, mlp_dim=64, rope_theta=10000.0,
               norm_eps=1e-5, tie_embeddings=False)
MODELS = {"llama": (Llama, LlamaConfig(**{**NUMBERS, "tie_embeddings": True})), "qwen3": (Qwen3, Qwen3Config(**NUMBERS))}
LAYOUTS = ("single", "tp2", "tp4")
PAGE_SIZE, NUM_PAGES = 4, 64
BUCKETS = Buckets(tokens=(16,), pairs=(0, 64), max_rows=8, max_pages=16)  # few shapes: each compiles per layout
REQUESTS = [(f"r{i}", np.random.default_rng(i).integers(0, 128, 3 + 9 * i).tolist(), SamplingParams(temperature=0.0, max_new_tokens=10))
            for i in range(3)]


def main() -> None:
    for model, (model_cls, cfg) in MODELS.items():
        reference = None
        for name in ((None,) if model == "llama" else ()) + LAYOUTS:  # None: no layout at all, the reference
            parallelism = load_config([f"parallelism={name or 'single'}"]).parallelism
            layout = None if name is None else make_layout(parallelism, jax.devices()[: parallelism.tensor])
            engine = Engine(model_cls(cfg, rngs=nnx.Rngs(0)), BUCKETS, PAGE_SIZE, NUM_PAGES, layout=layout)
            traces = Driver(engine, PAGE_SIZE, NUM_PAGES, budget=16, max_running=8, keep_logits=True).run(REQUESTS)
            logits = np.concatenate([np.stack(t.logits) for t in traces.values()])
            reference = logits if reference is None else reference
            header = next(iter(engine.forwards.values())).as_text().splitlines()[0]
            print(json.dumps({"model": model, "layout": name, "tokens": {rid: t.tokens for rid, t in traces.items()},
                              "max_diff": float(np.abs(logits - reference).max()), "aliases": header.count("may-alias"),
                              "cache_spec": str(getattr(engine.cache.k.sharding, "spec", None)), "recompiles": engine.compiles_after_ready}))


if __name__ == "__main__":
    main()
