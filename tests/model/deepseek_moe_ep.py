"""Run as a script under four fake CPU devices (tests/background.py starts it with
XLA_FLAGS=--xla_force_host_platform_device_count=4, which must be set before jax starts):
test_deepseek_moe.py's layer of each SHARDED variant under `ep`, its experts split over 2 devices (ep2: tokens
exchanged all-to-all) and their F over 2 more (tp2_ep2), with transformers' output and choice for the
same tokens. Writes them, and how many all-to-alls each compiled layer holds, to an .npz in a new
temporary directory, whose path is the last line printed (the test reads it, then removes the directory).

    python -m tests.model.deepseek_moe_ep
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxstream.config import load_config
from tests.model.test_deepseek_moe import SHARDED, hf_layer, ours, run, theirs, tokens
from worker_svc.layers.moe import Routed
from worker_svc.sharding import make_layout, place_params

LAYOUTS = ("ep2", "tp2_ep2")


def all_to_alls(moe: nnx.Module, x: jax.Array) -> int:
    graph, state = nnx.split(moe)
    step = jax.jit(lambda state, x: nnx.capture(nnx.merge(graph, state), Routed)(x))
    return step.lower(state, x).compile().as_text().count("all-to-all(")


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="deepseek_moe_ep-"))
    x = tokens()
    results = {}
    for variant in SHARDED:
        hf, tensors = hf_layer(variant, work / variant)
        results[f"{variant}/transformers/out"], results[f"{variant}/transformers/chosen"], _ = theirs(hf, x)
        for name in LAYOUTS:
            parallelism = load_config([f"parallelism={name}"]).parallelism
            layout = make_layout(parallelism, jax.devices()[:parallelism.tensor * parallelism.expert])
            moe = ours(variant, tensors, "ep", shards=layout.expert_shards())
            place_params(nnx.state(moe), layout)
            placed = jax.device_put(x, layout.replicated)
            results[f"{variant}/{name}/out"], results[f"{variant}/{name}/chosen"] = run(moe, placed)
            results[f"{variant}/{name}/all_to_all"] = np.asarray(all_to_alls(moe, placed))
    np.savez(work / "runs.npz", **results)
    print(work / "runs.npz", flush=True)


if __name__ == "__main__":
    main()
