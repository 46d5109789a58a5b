"""What a hybrid's decode step costs against the context: a random Qwen3.5 (Gated DeltaNet linear
layers and gated full attention, three linear then one full, as released) against a random Qwen3 of
the same width and layer count, the JAX engine alone (no Redis, no services), float32, on the CPU.

    python benchmarks/hybrid_decode.py [--contexts 256,1024,4096,16384] [--batches 1,8] [--steps 10] [--layers 8]

Each model's compile time first: from the engine's construction to every step shape compiled
(`compile_all`: what a worker does before it reports ready). Then decode steps of each batch at each
context, each the median of --steps runs after warm-up (worker_step.py's `timed`), and the hybrid's
time over Qwen3's. The cache is read through (token, page) pairs (page_list_tokens 0), so a step reads
the pages its rows hold, not the longest context's; and the engines are built without the CPU
kernels (XLA's products and attention). A linear layer's step reads its fixed-size state whatever the
context: only the hybrid's full-attention layers (a quarter) read pages. Decode timing does not
depend on what the cache holds, so contexts are set by the page table (worker_step.py's decode_step).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from worker_step import PAGE_SIZE, decode_step, timed  # noqa: E402
from worker_svc.batch import Buckets  # noqa: E402
from worker_svc.engine import Engine  # noqa: E402
from worker_svc.models.qwen3 import Qwen3, Qwen3Config  # noqa: E402
from worker_svc.models.qwen3_5 import Qwen3_5, Qwen3_5Config  # noqa: E402

WIDTH = dict(vocab=4096, dim=512, heads=8, kv_heads=2, head_dim=64, mlp_dim=1536, rope_theta=1e6, norm_eps=1e-6,
             tie_embeddings=False)
LINEAR = dict(linear_key_heads=4, linear_value_heads=8, linear_key_dim=64, linear_value_dim=64, conv_width=4, rotary_dim=16)


def models(layers: int) -> dict[str, tuple[type, object]]:
    pattern = tuple(i % 4 != 3 for i in range(layers))  # three linear, then one full
    return {"qwen3": (Qwen3, Qwen3Config(**WIDTH, layers=layers)),
            "qwen3_5": (Qwen3_5, Qwen3_5Config(**WIDTH, layers=layers, linear=pattern, **LINEAR))}


def buckets(batches: list[int], contexts: list[int]) -> Buckets:
    """Token buckets of the batches, pairs buckets of each batch's pages at each context."""
    pages = sorted({b * -(-c // PAGE_SIZE) for b in batches for c in contexts})
    return Buckets(tokens=tuple(sorted(set(batches))), pairs=tuple(pages), max_rows=max(batches),
                   max_pages=-(-max(contexts) // PAGE_SIZE), page_list_tokens=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="256,1024,4096,16384")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    contexts, batches = [int(c) for c in args.contexts.split(",")], [int(b) for b in args.batches.split(",")]
    shapes = buckets(batches, contexts)
    pages = max(batches) * shapes.max_pages
    ms: dict[str, dict[tuple[int, int], float]] = {}
    for name, (model_cls, cfg) in models(args.layers).items():
        started = time.perf_counter()
        engine = Engine(model_cls(cfg, rngs=nnx.Rngs(0)), shapes, PAGE_SIZE, pages)
        engine.executables.compile_all(progress=False)
        print(f"{name}: compile, start to ready {time.perf_counter() - started:.1f} s ({len(shapes.shapes())} step shapes)", flush=True)
        ms[name] = {}
        for b in batches:
            for c in contexts:
                ms[name][b, c] = timed(engine, lambda i, b=b, c=c: decode_step(b, c, i), args.steps)
        del engine
        gc.collect()
    print(f"\ndecode ms/step (median of {args.steps}), {args.layers} layers, dim {WIDTH['dim']}, float32, XLA:CPU")
    print(f"{'batch':>5} {'context':>7} {'qwen3':>9} {'qwen3_5':>9} {'ratio':>6}")
    for b in batches:
        for c in contexts:
            q, h = ms["qwen3"][b, c], ms["qwen3_5"][b, c]
            print(f"{b:>5} {c:>7} {q:>9.2f} {h:>9.2f} {h / q:>6.2f}")
    for name in ms:
        print(f"{name}: longest over shortest context " + ", ".join(
            f"batch {b} {ms[name][b, contexts[-1]] / ms[name][b, contexts[0]]:.2f}x" for b in batches))


if __name__ == "__main__":
    main()
