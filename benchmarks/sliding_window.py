"""A sliding-window layer's decode cost as the context grows: one decode step of a small random
Mistral whose every layer slides by a window, against the same model (the same weights) without one,
at several contexts, the two engines in alternation.

    python benchmarks/sliding_window.py [--window 256] [--batch 8] [--steps 10] [--rounds 3] [--attention-kernel on|off]

Prints the median ms/step of each model per context and round. A windowed decode reads only the
cache pages inside the window (layers/attention.py's page-list loop starts at the first page any
token of the step still sees; the CPU attention kernel starts each token at its window's first
position), so its step time should stay flat from the window on while the full model's grows. The
whole engine step is timed (forward, sampling, read-back); contexts are set by the page table, as
in worker_step.py.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flax import nnx  # noqa: E402
from worker_step import PAGE_SIZE, decode_step, median_ms  # noqa: E402
from worker_svc.batch import Buckets  # noqa: E402
from worker_svc.cpu_kernels import attention_kernel  # noqa: E402
from worker_svc.cpu_kernels.kernels import CpuKernels  # noqa: E402
from worker_svc.engine import Engine  # noqa: E402
from worker_svc.layers.numerics import Numerics  # noqa: E402
from worker_svc.models.mistral import Mistral, MistralConfig  # noqa: E402

CONTEXTS = (256, 1024, 4096)
# Attention-heavy for its size: 8 query heads of 64 over 2 KV heads, 4 layers, a small MLP and vocabulary.
MODEL = MistralConfig(vocab=1024, dim=256, layers=4, heads=8, kv_heads=2, head_dim=64, mlp_dim=512, rope_theta=10000.0,
                      norm_eps=1e-6, tie_embeddings=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--attention-kernel", choices=("on", "off"), default="on")
    args = parser.parse_args()

    kernels = None
    if args.attention_kernel == "on":
        why = attention_kernel.load()
        if why:
            raise SystemExit(f"the attention kernel is not available: {why} (--attention-kernel off runs without it)")
        kernels = CpuKernels(attention=True)
    pages = max(CONTEXTS) // PAGE_SIZE
    buckets = Buckets(tokens=(args.batch,), pairs=(0,), max_rows=args.batch, max_pages=pages, page_list_tokens=args.batch)
    engines = {}
    for name, windows in (("full", None), (f"window {args.window}", (args.window,) * MODEL.layers)):
        model = Mistral(replace(MODEL, windows=windows, numerics=Numerics(kernels=kernels)), rngs=nnx.Rngs(0))
        engines[name] = Engine(model, buckets, PAGE_SIZE, args.batch * pages + 64)
    print(f"# median ms/step of {args.steps} decode steps of {args.batch} rows, {args.rounds} rounds in alternation; "
          f"attention kernel {args.attention_kernel}")
    for context in CONTEXTS:
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                times[name].append(median_ms(lambda e=engine: e.step(decode_step(args.batch, context, 0)).token_ids, args.steps))
        rounds = "  ".join(f"{name} " + "/".join(f"{t:.2f}" for t in ts) for name, ts in times.items())
        print(f"context {context:>5}: {rounds}", flush=True)


if __name__ == "__main__":
    main()
