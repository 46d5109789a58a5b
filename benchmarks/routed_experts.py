"""What routed experts export (worker.enable_return_routed_experts) costs per step and on the wire:
the JAX engine alone, the tiny random Qwen3-MoE of configs/model (or --model), three engines side by
side: the switch off, on with no request asking, on with every request asking. Medians of --steps
runs, interleaved so the machine's noise falls on all three alike.

    python benchmarks/routed_experts.py [--model qwen3_moe_tiny] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxstream.arrays import to_wire  # noqa: E402
from jaxstream.config import load_config  # noqa: E402
from jaxstream.protocol import SamplingParams, Step, StepSeq, encode  # noqa: E402
from worker_svc.start import build_engine  # noqa: E402

PAGE_SIZE = 16


def step(batch: int, tokens_each: int, step_id: int, sampling: SamplingParams | None) -> Step:
    """Each row feeds `tokens_each` tokens at the start of its context (a prefill) or, with 1, a
    decode at position 63; pages laid out row after row."""
    context = tokens_each if tokens_each > 1 else 64
    pages = -(-context // PAGE_SIZE)
    table = np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
    seqs = tuple(StepSeq(f"r{i}", i * tokens_each, tokens_each, context, True, sampling, slot=i) for i in range(batch))
    positions = np.tile(np.arange(context - tokens_each, context, dtype=np.int32), batch)
    return Step(step_id, seqs, to_wire(np.full(batch * tokens_each, 42, np.int32)), to_wire(positions), to_wire(table))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3_moe_tiny")
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    small = [f"model={a.model}", "worker.token_buckets=[8,256]", "worker.pair_buckets=[0,64]", "scheduler.max_running_requests=8",
             "scheduler.max_tokens_per_step=256", "scheduler.num_pages=256", "model.max_model_len=512", "worker.compile_cache_dir=null"]
    engines = {name: build_engine(load_config([*small, f"worker.enable_return_routed_experts={on}"]), progress=False)
               for name, on in (("off", "false"), ("on", "true"), ("on+asked", "true"))}
    plain, asks = SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, return_routed_experts=True)
    facts = engines["on"].facts
    print(f"{a.model}: median step ms over {a.steps} runs (moe_layers {facts.moe_layers}, "
          f"L {facts.num_hidden_layers}, k {facts.num_experts_per_tok})")
    print(f"{'step':>22} {'off':>8} {'on':>8} {'on+asked':>9} {'result bytes off':>17} {'asked':>7} {'per token':>10}")
    for label, batch, each in (("decode x8", 8, 1), ("prefill 1 x 256", 1, 256)):
        times: dict[str, list[float]] = {name: [] for name in engines}
        sizes = {}
        for i in range(a.steps + 2):  # two warm-up rounds
            for name, engine in engines.items():
                # Sampling once per slot, as the scheduler sends it: a decode row's later steps bring
                # none (a first seq since admission would read back its whole cached context).
                s = step(batch, each, i, (asks if name == "on+asked" else plain) if i == 0 or each > 1 else None)
                started = time.perf_counter()
                result = engine.step(s)
                if i >= 2:
                    times[name].append((time.perf_counter() - started) * 1e3)
                sizes[name] = len(encode(result))
        med = {name: statistics.median(t) for name, t in times.items()}
        extra = (sizes["on+asked"] - sizes["off"]) / (batch * each)
        print(f"{label:>22} {med['off']:8.2f} {med['on']:8.2f} {med['on+asked']:9.2f} {sizes['off']:17d} {sizes['on+asked']:7d} {extra:10.1f}")


if __name__ == "__main__":
    main()
