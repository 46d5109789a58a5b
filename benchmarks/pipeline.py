"""The whole stack under concurrent streams: throughput, time to first token, inter-token latency.

    python benchmarks/pipeline.py [OVERRIDES...] [--concurrency 32] [--prompt-len 128] [--output-len 128] [--rounds 3]

Starts `jaxstream up` with the overrides on a free port unless --base-url is given; the worker is
the fake one unless an override says otherwise. With `worker=fake` (whose step takes
microseconds) the figures are what the services and Redis cost per step; with `worker=jax` they
are the served model's. Prints one row per round and the median row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from contextlib import nullcontext

import httpx

from serving import jaxstream_up


async def one(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> tuple[float, list[float], float, int]:
    body = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    arrivals = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                if json.loads(line[6:])["choices"]:
                    arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return arrivals[0] - start, gaps, arrivals[-1] - start, len(arrivals)


async def round_(base_url: str, concurrency: int, prompt_len: int, output_len: int, seed: int) -> dict:
    prompts = [[(seed * 7919 + i * 131 + j) % 40000 + 100 for j in range(prompt_len)] for i in range(concurrency)]
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, p, output_len) for p in prompts))
        wall = time.perf_counter() - start
    ttft = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    chunks = sum(r[3] for r in results)  # SSE events with text (a held-back character merges two)
    return {
        "out_tok_s": concurrency * output_len / wall,
        "ttft_p50_ms": statistics.median(ttft) * 1000,
        # all streams decode together, one token per step: wall time per output token is a step
        "ms_per_step": wall / output_len * 1000,
        "itl_p90_ms": statistics.quantiles(gaps, n=10)[-1] * 1000,
        "e2e_p50_s": statistics.median(r[2] for r in results),
        "chunks": chunks,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="for jaxstream up, e.g. worker=jax scheduler.max_tokens_per_step=512")
    ap.add_argument("--base-url")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    overrides = args.overrides if any(o.startswith("worker=") for o in args.overrides) else ["worker=fake", *args.overrides]
    with (nullcontext(args.base_url) if args.base_url else jaxstream_up(overrides)) as base_url:
        asyncio.run(round_(base_url, 2, 8, 8, seed=99))  # warm-up
        rows = [asyncio.run(round_(base_url, args.concurrency, args.prompt_len, args.output_len, seed=r)) for r in range(args.rounds)]
    keys = list(rows[0])
    print(f"{args.base_url or ' '.join(overrides)}: {args.concurrency} streams, "
          f"{args.prompt_len} prompt / {args.output_len} output tokens")
    print("round   " + "  ".join(f"{k:>12}" for k in keys))
    for i, row in enumerate(rows):
        print(f"{i:<8}" + "  ".join(f"{row[k]:>12.2f}" for k in keys))
    print("median  " + "  ".join(f"{statistics.median(r[k] for r in rows):>12.2f}" for k in keys))


if __name__ == "__main__":
    main()
