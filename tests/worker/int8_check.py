"""Run as a script under fake CPU devices (test_quantization.py starts it with
XLA_FLAGS=--xla_force_host_platform_device_count=4, which must be set before jax starts): int8 weights
(worker.quantization) on tp_check.py's tiny models, served on one device and split over two. Prints one
JSON line per (model, layout): greedy tokens, the max |logit - the single-device int8 run's| (ep's:
fused's, on one device), and the specs of an int8 weight's values and scale; and one for a hot swap
under tp2: a float model's
tensors pushed by name into an int8 Llama, whether every leaf kept its sharding and dtype, whether it
then serves what an int8 engine loaded from that model's checkpoint serves (bitwise), and the
compilations after."""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxstream.config import load_config
from jaxstream.protocol import SamplingParams
from tests.worker.driver import Driver
from tests.worker.test_swap import write_checkpoint
from tests.worker.tp_check import BUCKETS, MODELS, NUM_PAGES, PAGE_SIZE
from worker_svc.compiles import counter
from worker_svc.engine import Engine
from worker_svc.hf_index import hf_tensors
from worker_svc.layers.numerics import Numerics
from worker_svc.loading import load_model
from worker_svc.sharding import make_layout
from worker_svc.weights import open_checkpoint

INT8 = Numerics(quantization="int8")
LAYOUTS = {"llama": ("tp2",), "qwen3_moe": (), "qwen3_moe_ep": ("ep2",)}  # qwen3_moe: the reference of ep2
# One prefill step of three prompts, a token each: one step shape per engine (each compiles its own).
REQUESTS = [(f"r{i}", np.random.default_rng(i).integers(0, 128, 3 + 2 * i).tolist(), SamplingParams(temperature=0.0, max_new_tokens=1))
            for i in range(3)]


def serve(engine: Engine) -> tuple[dict, np.ndarray]:
    traces = Driver(engine, PAGE_SIZE, NUM_PAGES, budget=16, max_running=8, keep_logits=True).run(REQUESTS)
    return {rid: t.tokens for rid, t in traces.items()}, np.concatenate([np.stack(t.logits) for t in traces.values()])


def engine_of(model_cls, cfg, layout, seed: int = 0) -> Engine:
    if layout is not None and getattr(cfg, "moe", None) == "ep":
        cfg = replace(cfg, shards=layout.expert_shards())
    return Engine(model_cls(replace(cfg, numerics=INT8), rngs=nnx.Rngs(seed)), BUCKETS, PAGE_SIZE, NUM_PAGES, layout=layout)


def layout_of(name: str):
    parallelism = load_config([f"parallelism={name}"]).parallelism
    return make_layout(parallelism, jax.devices()[: parallelism.tensor * parallelism.expert])


def main() -> None:
    references: dict[str, np.ndarray] = {}
    for model, layouts in LAYOUTS.items():
        model_cls, cfg = MODELS[model]
        if model != "qwen3_moe_ep":  # ep's reference is fused's: the same weights, one device
            tokens, references[model] = serve(engine_of(model_cls, cfg, None))
            print(json.dumps({"model": model, "layout": None, "tokens": tokens}))
        for name in layouts:
            engine = engine_of(model_cls, cfg, layout_of(name))
            tokens, logits = serve(engine)
            specs = {path[-1]: str(var[...].sharding.spec) for path, var in nnx.to_flat_state(engine.params)
                     if path[:-1] in (("layers", "mlp", "gate"), ("moe_layers", "mlp", "experts", "down"))}
            reference = references[model.removesuffix("_ep")]
            print(json.dumps({"model": model, "layout": name, "tokens": tokens, "max_diff": float(np.abs(logits - reference).max()),
                              "specs": specs, "recompiles": engine.compiles_after_ready}))
            if (model, name) == ("llama", "tp2"):
                swap(engine, model_cls, cfg)


def swap(engine: Engine, model_cls, cfg) -> None:
    """Push a float model's tensors into the served int8 engine (its shapes compiled and used)."""
    live = nnx.to_flat_state(engine.params)
    target = model_cls(cfg, rngs=nnx.Rngs(1))  # float32
    compiles = counter().count
    engine.stage_tensors(hf_tensors(target))
    engine.commit_weights()
    _, after = serve(engine)
    recompiles = counter().count - compiles
    kept = all((new[...].sharding, new[...].dtype, new[...].shape) == (old[...].sharding, old[...].dtype, old[...].shape)
               for (_, new), (_, old) in zip(nnx.to_flat_state(engine.params), live))
    with tempfile.TemporaryDirectory() as directory:  # target as a checkpoint, loaded int8 into tp2 as a worker loads it
        checkpoint = open_checkpoint(write_checkpoint(Path(directory) / "target", target))
        layout = engine.layout
        _, fresh = serve(Engine(load_model(checkpoint, progress=False, layout=layout, numerics=INT8), BUCKETS, PAGE_SIZE,
                                NUM_PAGES, layout=layout))
    print(json.dumps({"swap": "tp2", "kept": kept, "same_logits": bool(np.array_equal(after, fresh)), "recompiles": recompiles}))


if __name__ == "__main__":
    main()
