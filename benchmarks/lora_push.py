"""An RL trainer's LoRA adapter push against its full-weight push, into one live stack (JAX worker,
SmolLM2 by default), side by side on loopback:

    python benchmarks/lora_push.py [--repeats 5] [overrides...]

Starts `jaxstream up worker.weights=dummy` with adapter slots (worker.lora.max_adapters=1,
max_rank=16, every target module) and, `--repeats` times each, in alternation, times:
- `jaxstream.rl.push_weights` of the whole model (the bundled GGUF's tensors, read once before
  timing, in float32), in `--bucket-mb` buckets: what a full-weight trainer sends every step;
- `jaxstream.rl.push_adapter` of a random adapter (PEFT's names and layouts) of rank 8 and 16, on
  the attention projections (q, k, v, o) and on every projection the model lets an adapter target
  (q, k, v, o and the MLP's gate, up, down; a mixture of experts' MLP is never adapted), into one
  adapter name: what a LoRA trainer sends instead. Each push ends with the swap between steps.
The targets come from the served weights (/list_weights), so overrides may name another model
(e.g. `model=qwen3_moe_tiny`, whose only dense MLP is one layer's). Prints each push's bytes
(float32, as pushed), median seconds, MB/s and its share of the full push's time, then that a
request under the adapter answers and how many compiles came after ready.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.weight_update import checkpoint_tensors, timed  # noqa: E402
from jaxstream import rl  # noqa: E402
from stack.bench.stacks import jaxstream_up  # noqa: E402

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# A projection's weight an adapter may target: attention's, or a dense MLP's (not an expert's, not a router's)
ADAPTABLE = re.compile(r"^(model\.layers\.\d+\.(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj))\.weight$")
NAME = "bench"
SLOTS = ["worker.lora.max_adapters=1", "worker.lora.max_rank=16"]


def adapter(served: list[dict], rank: int, modules: tuple[str, ...], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A random adapter of `rank` on `modules`, by PEFT's names: lora_A [r, in], lora_B [out, r]."""
    tensors = {}
    for w in served:
        match = ADAPTABLE.match(w["name"])
        if match and match.group(1).rsplit(".", 1)[1] in modules:
            out, into = w["shape"]
            tensors[f"base_model.model.{match.group(1)}.lora_A.weight"] = rng.standard_normal((rank, into), np.float32) * into**-0.5
            tensors[f"base_model.model.{match.group(1)}.lora_B.weight"] = rng.standard_normal((out, rank), np.float32) * rank**-0.5
    return tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=256, help="both pushes' bucket size")
    args, overrides = parser.parse_known_args()
    bucket = int(args.bucket_mb * (1 << 20))
    rng = np.random.default_rng(0)
    with jaxstream_up(["worker.weights=dummy", *SLOTS, *overrides]) as base:
        served = rl.list_weights(base)
        full = checkpoint_tensors() if not any(o.startswith("model=") for o in overrides) else {
            w["name"]: rng.standard_normal(w["shape"], np.float32) * 0.02 for w in served}  # another model: random, its shapes
        found = {ADAPTABLE.match(w["name"]).group(1).rsplit(".", 1)[1] for w in served if ADAPTABLE.match(w["name"])}
        every = tuple(m for m in ATTENTION + MLP if m in found)
        pushes = {"full weights (push_weights)": (lambda i: rl.push_weights(base, full, bucket_bytes=bucket, weight_version=f"full-{i}"),
                                                  sum(t.nbytes for t in full.values()))}
        for rank in (8, 16):
            for label, modules in (("attention", ATTENTION), ("all" if every != ATTENTION else "all (= attention)", every)):
                tensors = adapter(served, rank, modules, rng)

                def push(i, tensors=tensors, rank=rank, modules=modules):
                    return rl.push_adapter(base, NAME, tensors, rank=rank, alpha=2 * rank, target_modules=modules,
                                           bucket_bytes=bucket, weight_version=f"lora-{i}")

                pushes[f"adapter r{rank}, {label} ({len(tensors) // 2} modules)"] = (push, sum(t.nbytes for t in tensors.values()))
        times: dict[str, list[float]] = {what: [] for what in pushes}
        for i in range(args.repeats):
            for what, (push, _) in pushes.items():
                times[what].append(timed(lambda: push(i)))
        answer = httpx.post(base + "/generate", timeout=300, json={
            "text": "The capital of France is", "lora_path": NAME, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}).json()
        compiles = [s["compiles_after_ready"] for s in httpx.get(base + "/stats", timeout=10).json()["worker"].values()]
    model = next((o for o in overrides if o.startswith("model=")), "model=smollm2 (SmolLM2-135M-Instruct)")
    full_s = statistics.median(times["full weights (push_weights)"])
    print(f"# {model}; weights=dummy; buckets of {args.bucket_mb:g} MiB; median of {args.repeats}; loopback")
    print(f"{'push':44} {'MB':>9} {'seconds':>8} {'MB/s':>7} {'of full':>8}")
    for what, (_, size) in pushes.items():
        seconds = statistics.median(times[what])
        print(f"{what:44} {size / 1e6:9.3f} {seconds:8.3f} {size / 1e6 / seconds:7.1f} {seconds / full_s:8.3f}")
    print(f"under the adapter: weight_version {answer['meta_info']['weight_version']!r}, {answer['text']!r}; "
          f"compiles after ready: {compiles}")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"run took {time.perf_counter() - started:.0f} s")
