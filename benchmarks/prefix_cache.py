"""Time to first token with and without the prefix cache: many requests sharing a long prefix.

    python benchmarks/prefix_cache.py [OVERRIDES...] [--requests 100] [--prefix-len 1000] [--suffix-len 16]
                                      [--output-len 8] [--concurrency 100]

Runs the same workload against two `jaxstream up` stacks, one after the other in this run, the
same but for `scheduler.prefix_cache=true` / `false` (SmolLM2 with its real weights unless an
override says otherwise): one warm-up request (the shared prefix and a suffix of its own, so the
cache holds the prefix, as a shared system prompt would be), then `--requests` requests, each the
same prefix and a distinct suffix, `--concurrency` at a time, streamed (`/v1/completions`,
token-id prompts): the time to first token is the first streamed token's arrival. Prints median
and p90 TTFT, each stack's wall time and cached tokens, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

from serving import jaxstream_up

# Enough KV pages for every running request to hold its whole context without the cache
# (64 running x ~1,030 tokens in pages of 16), and a context that holds the prompt.
DEFAULTS = ("model.max_model_len=2048", "scheduler.num_pages=4608")


async def one(client: httpx.AsyncClient, prompt: list[int], output_len: int, gate: asyncio.Semaphore) -> tuple[float, int]:
    """(seconds to the first token, prompt tokens read from the cache)."""
    body = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    async with gate:
        start = time.perf_counter()
        first, cached = None, 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and first is None:
                    first = time.perf_counter() - start
                if chunk.get("usage"):
                    cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first, cached


async def workload(base_url: str, args: argparse.Namespace) -> dict:
    rng = random.Random(0)  # the same tokens for both stacks
    prefix = [rng.randrange(100, 40000) for _ in range(args.prefix_len)]
    suffixes = [[rng.randrange(100, 40000) for _ in range(args.suffix_len)] for _ in range(args.requests + 1)]
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=1800, limits=limits) as client:
        await one(client, prefix + suffixes[-1], args.output_len, asyncio.Semaphore(1))  # warm-up
        gate = asyncio.Semaphore(args.concurrency)
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, prefix + s, args.output_len, gate) for s in suffixes[:-1]))
        wall = time.perf_counter() - start
    ttft = sorted(r[0] for r in results)
    return {"ttft_p50_s": statistics.median(ttft), "ttft_p90_s": statistics.quantiles(ttft, n=10)[-1],
            "wall_s": wall, "cached_p50": statistics.median(r[1] for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help=f"for jaxstream up (after {' '.join(DEFAULTS)})")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=100)
    args = ap.parse_args()
    rows = {}
    for cache in ("true", "false"):
        overrides = [*DEFAULTS, *args.overrides, f"scheduler.prefix_cache={cache}"]
        with jaxstream_up(overrides) as base_url:
            rows[cache] = asyncio.run(workload(base_url, args))
    print(f"{args.requests} requests ({args.concurrency} at a time): a {args.prefix_len}-token shared prefix + "
          f"{args.suffix_len} tokens of their own, {args.output_len} output tokens; {' '.join([*DEFAULTS, *args.overrides])}")
    keys = list(rows["true"])
    print("prefix_cache  " + "  ".join(f"{k:>11}" for k in keys))
    for cache, row in rows.items():
        print(f"{cache:<14}" + "  ".join(f"{row[k]:>11.2f}" for k in keys))
    print(f"median TTFT without / with the prefix cache: {rows['false']['ttft_p50_s'] / rows['true']['ttft_p50_s']:.1f}x")


if __name__ == "__main__":
    main()
