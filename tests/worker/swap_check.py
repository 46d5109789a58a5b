"""Run as a script under fake CPU devices (test_swap.py starts it with
XLA_FLAGS=--xla_force_host_platform_device_count=4, which must be set before jax starts): a tiny
Llama served with tensor parallelism over 2 devices takes another model's weights by name, and
prints one JSON line: whether every swapped leaf kept its live leaf's sharding, whether the engine
then gives a fresh engine's logits with those weights (bitwise) and not its old ones, and how many
compilations the swap and the steps after it caused."""

from __future__ import annotations

import json

import jax
import numpy as np
from flax import nnx

from jaxstream.config import load_config
from jaxstream.protocol import SamplingParams
from tests.worker.driver import Driver
from worker_svc.batch import Buckets
from worker_svc.compiles import counter
from worker_svc.engine import Engine
from worker_svc.hf_index import hf_tensors
from worker_svc.models.llama import Llama, LlamaConfig
from worker_svc.sharding import make_layout

CFG = LlamaConfig(vocab=128, dim=32, layers=2, heads=8, kv_heads=4, head_dim=8, mlp_dim=64, rope_theta=10000.0,
                  norm_eps=1e-5, tie_embeddings=False)
PAGE_SIZE, NUM_PAGES = 4, 16
BUCKETS = Buckets(tokens=(16,), pairs=(0, 16), max_rows=2, max_pages=8)
REQUEST = ("x", list(range(3, 12)), SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True))


def logits(engine: Engine) -> np.ndarray:
    return np.stack(Driver(engine, PAGE_SIZE, NUM_PAGES, budget=16, max_running=2, keep_logits=True).run([REQUEST])["x"].logits)


def main() -> None:
    layout = make_layout(load_config(["parallelism=tp2"]).parallelism, jax.devices()[:2])
    engine = Engine(Llama(CFG, rngs=nnx.Rngs(0)), BUCKETS, PAGE_SIZE, NUM_PAGES, layout=layout)
    before, live = logits(engine), nnx.to_flat_state(engine.params)  # compiles the shapes the request uses
    target = Llama(CFG, rngs=nnx.Rngs(1))
    compiles = counter().count
    engine.stage_tensors(hf_tensors(target))
    engine.commit_weights()
    after = logits(engine)
    recompiles = counter().count - compiles
    swapped = nnx.to_flat_state(engine.params)
    same_shardings = all(new[...].sharding == old[...].sharding and new[...] is not old[...]
                         for (_, new), (_, old) in zip(swapped, live))
    fresh = logits(Engine(target, BUCKETS, PAGE_SIZE, NUM_PAGES, layout=layout))
    print(json.dumps({"same_shardings": same_shardings, "same_logits": bool(np.array_equal(after, fresh)),
                      "changed": not np.array_equal(after, before), "recompiles": recompiles}))


if __name__ == "__main__":
    main()
