"""The MoE layer alone, `fused` against `ep` (layers/moe.py), on one device: ms per call (median of
--repeat), for a few token counts. Prints one table; the two strategies alternate, so the ratio
holds on a noisy machine.

    python benchmarks/moe_layer.py --experts 64 --top-k 4 --dim 512 --hidden 256
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.moe import MoE


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", default="8,64,512")
    p.add_argument("--repeat", type=int, default=20)
    a = p.parse_args()
    layers = {s: MoE(a.dim, a.hidden, a.experts, a.top_k, norm_topk_prob=True, strategy=s, dtype=jnp.float32,
                     rngs=nnx.Rngs(0)) for s in ("fused", "ep")}
    call = jax.jit(lambda m, x: nnx.capture(m)(x))  # capture: the routed experts sown are not kept
    print(f"{jax.devices()[0].platform}: E={a.experts} k={a.top_k} D={a.dim} F={a.hidden}")
    print(f"{'tokens':>7} {'fused ms':>10} {'ep ms':>10} {'fused/ep':>9} {'max |diff|':>11}")
    for tokens in map(int, a.tokens.split(",")):
        x = jax.random.normal(jax.random.key(tokens), (tokens, a.dim))
        outs = {s: call(m, x).block_until_ready() for s, m in layers.items()}  # compile
        times = {s: [] for s in layers}
        for _ in range(a.repeat):
            for s, m in layers.items():
                start = time.perf_counter()
                call(m, x).block_until_ready()
                times[s].append((time.perf_counter() - start) * 1e3)
        fused, ep = (statistics.median(times[s]) for s in ("fused", "ep"))
        diff = float(jnp.abs(outs["fused"] - outs["ep"]).max())
        print(f"{tokens:>7} {fused:>10.2f} {ep:>10.2f} {fused / ep:>9.2f} {diff:>11.2e}")


if __name__ == "__main__":
    main()
