"""Run as a script under fake CPU devices (test_quantization.py starts it with
XLA_FLAGS=--xla_force_host_platform_device_count=4, which must be set before jax starts): int8 weights
(worker.quantization) on tp_check.py's tiny models, served on one device and split over two. Prints one
JSON line per (model, layout): greedy tokens, the max |logit - the single-device int8 run's| (ep's:
fused's, on one device), and the specs of an int8 weight's values and scale; and one for a hot swap
under tp2: a float model's
tensors pushed by name into an int8 Llama, whether every leaf kept its sharding and dtype, whether
the leaves are those load_model gives from that model's checkpoint (bitwise: the same values and
scales serve the same logits), and the compilations the swap and a step after it caused."""

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


def built(model_cls, cfg, seed: int = 0) -> nnx.Module:
    """model_cls(cfg, rngs=nnx.Rngs(seed)), its random weights drawn in one jitted call: one compile,
    where building it eagerly compiles each of its initializers' and quantize's operations (~2 s
    more a model here)."""
    graph = nnx.graphdef(nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(seed))))
    return nnx.merge(graph, jax.jit(lambda: nnx.state(model_cls(cfg, rngs=nnx.Rngs(seed))))())


def engine_of(model: nnx.Module, model_cls, cfg, layout) -> Engine:
    """An engine of `model`'s weights (shared, not copied: jax arrays are immutable) as a `model_cls`
    of `cfg`: the weights built once serve every layout, and fused's serve ep."""
    if layout is not None and getattr(cfg, "moe", None) == "ep":
        cfg = replace(cfg, shards=layout.expert_shards())
    graph = nnx.graphdef(nnx.eval_shape(lambda: model_cls(replace(cfg, numerics=INT8), rngs=nnx.Rngs(0))))
    return Engine(nnx.merge(graph, jax.tree.map(lambda a: a, nnx.state(model))), BUCKETS, PAGE_SIZE, NUM_PAGES, layout=layout)


def layout_of(name: str):
    parallelism = load_config([f"parallelism={name}"]).parallelism
    return make_layout(parallelism, jax.devices()[: parallelism.tensor * parallelism.expert])


def main() -> None:
    references: dict[str, np.ndarray] = {}
    weights: dict[str, nnx.Module] = {}
    for model, layouts in LAYOUTS.items():
        model_cls, cfg = MODELS[model]
        base = model.removesuffix("_ep")
        if base not in weights:
            weights[base] = built(model_cls, replace(MODELS[base][1], numerics=INT8))
        if model == base:  # ep's reference is fused's: the same weights, one device
            tokens, references[model] = serve(engine_of(weights[base], model_cls, cfg, None))
            print(json.dumps({"model": model, "layout": None, "tokens": tokens}))
        for name in layouts:
            engine = engine_of(weights[base], model_cls, cfg, layout_of(name))
            tokens, logits = serve(engine)
            specs = {path[-1]: str(var[...].sharding.spec) for path, var in nnx.to_flat_state(engine.params)
                     if path[:-1] in (("layers", "mlp", "gate"), ("moe_layers", "mlp", "experts", "down"))}
            print(json.dumps({"model": model, "layout": name, "tokens": tokens, "max_diff": float(np.abs(logits - references[base]).max()),
                              "specs": specs, "recompiles": engine.compiles_after_ready}))
            if (model, name) == ("llama", "tp2"):
                swap(engine, model_cls, cfg)


def swap(engine: Engine, model_cls, cfg) -> None:
    """Push a float model's tensors into the served int8 engine (its shapes compiled and used)."""
    live = nnx.to_flat_state(engine.params)
    target = built(model_cls, cfg, seed=1)  # float32
    compiles = counter().count
    engine.stage_tensors(hf_tensors(target))
    engine.commit_weights()
    serve(engine)
    recompiles = counter().count - compiles
    swapped = nnx.to_flat_state(engine.params)
    kept = all((new[...].sharding, new[...].dtype, new[...].shape) == (old[...].sharding, old[...].dtype, old[...].shape)
               for (_, new), (_, old) in zip(swapped, live))
    with tempfile.TemporaryDirectory() as directory:  # target as a checkpoint, loaded int8 into tp2 as a worker loads it
        checkpoint = open_checkpoint(write_checkpoint(Path(directory) / "target", target))
        loaded = nnx.to_flat_state(nnx.state(load_model(checkpoint, progress=False, layout=engine.layout, numerics=INT8)))
    same = all(np.array_equal(new[...], want[...]) for (_, new), (_, want) in zip(swapped, loaded))
    print(json.dumps({"swap": "tp2", "kept": kept, "same_params": same, "recompiles": recompiles}))


if __name__ == "__main__":
    main()
