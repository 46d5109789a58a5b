"""Weight-sync throughput into a live stack (JAX worker, SmolLM2), the three ways a trainer can move
weights, side by side on loopback:

    python benchmarks/weight_sync.py [--repeats 3] [--bucket-mb 256] [overrides...]

Starts `jaxstream up worker.weights=dummy` (random weights) and, `--repeats` times each, times a
whole update to the real weights (read from the bundled GGUF once, before timing, in float32):
- `/update_weights_from_disk` of the GGUF (the server reads and dequantizes it itself);
- `/update_weights_from_tensor` by `jaxstream.rl.push_weights` (safetensors bytes over HTTP, through
  Redis to the worker), in `--bucket-mb` buckets;
- collective, SGLang's dialect: this process is a plain torch.distributed trainer
  (examples/collective_sync.py, gloo on loopback) broadcasting `--bucket-mb` buckets, each
  swapped in as its /update_weights_from_distributed answers;
- collective, vLLM's dialect: the same group, vLLM's packed buffers of `--bucket-mb`, one swap at
  /finish_weight_update.
The group is joined once, before timing (its join time is printed too). GB/s counts the bytes of
the weights as served (float32), over the whole update; every update ends with the swap.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.weight_update import BUNDLED, served_bytes, timed  # noqa: E402
from examples.collective_sync import CollectiveTrainer, checkpoint_tensors  # noqa: E402
from jaxstream import rl  # noqa: E402
from stack.bench.stacks import jaxstream_up  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=256)
    args, overrides = parser.parse_known_args()
    bucket = int(args.bucket_mb * (1 << 20))
    tensors = checkpoint_tensors(BUNDLED)  # torch views of numpy arrays: one host copy serves both pushes
    arrays = {name: t.numpy() for name, t in tensors.items()}
    rows: dict[str, list[float]] = {"update from disk": [], "update from tensor (HTTP, Redis)": [],
                                    "collective, SGLang's dialect": [], "collective, vLLM's dialect (packed)": []}
    with jaxstream_up(["worker.weights=dummy", *overrides]) as base:
        size = served_bytes(base)
        with CollectiveTrainer(base) as sglang, CollectiveTrainer(base, dialect="vllm") as vllm:
            joins = [timed(sglang.join), timed(vllm.join)]
            for i in range(args.repeats):
                rows["update from disk"].append(timed(lambda: rl.update_from_disk(base, BUNDLED, weight_version=f"disk-{i}")))
                rows["update from tensor (HTTP, Redis)"].append(
                    timed(lambda: rl.push_weights(base, arrays, bucket_bytes=bucket, weight_version=f"tensor-{i}")))
                rows["collective, SGLang's dialect"].append(
                    timed(lambda: sglang.send(tensors, bucket_bytes=bucket, weight_version=f"sglang-{i}")))
                rows["collective, vLLM's dialect (packed)"].append(
                    timed(lambda: vllm.send(tensors, bucket_bytes=bucket, weight_version=f"vllm-{i}")))
        compiles = [s["compiles_after_ready"] for s in httpx.get(base + "/stats", timeout=10).json()["worker"].values()]
        answer = httpx.post(base + "/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0, "max_tokens": 12,
        }).json()["choices"][0]["message"]["content"]
    print(f"# SmolLM2-135M-Instruct: {size / 1e9:.3f} GB of weights served (float32); buckets of {args.bucket_mb:g} MiB; "
          f"median of {args.repeats}; loopback")
    print(f"{'how':38} {'seconds':>8} {'GB/s':>6}")
    for name, values in rows.items():
        seconds = statistics.median(values)
        print(f"{name:38} {seconds:8.2f} {size / 1e9 / seconds:6.2f}")
    print(f"joining the group (once): {joins[0]:.2f} s (SGLang's), {joins[1]:.2f} s (vLLM's)")
    print(f"compiles after ready: {compiles}; the answer after the last update: {answer!r}")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"run took {time.perf_counter() - started:.0f} s")
