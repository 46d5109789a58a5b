"""What constrained decoding costs the requests beside it: output throughput at N concurrent streams
with 0, 4 and N of them constrained to a JSON schema, side by side in one run, and the worker's
mask time per step.

    python benchmarks/structured.py [OVERRIDES...] [--concurrency 32] [--output-len 128] [--rounds 3]
                                    [--mixes 0,4,32]

Starts one stack (`jaxstream up`, the JAX worker on the bundled model unless an override says
otherwise) and, per round, runs each mix in turn: `concurrency` chat completions at once, twice
over (2 x concurrency requests), `mix` of them with response_format json_schema. Every request
makes exactly `output-len` tokens, so the batch is the same size in every mix: unconstrained ones
ignore EOS, constrained ones follow a schema no output of that length completes (an array of at
least 1,000 objects), so they end by length too. Prints each round's output tokens/s per mix,
the medians and their ratio to the unconstrained mix, and after each constrained mix the worker's
mask time per step (p50, p99 over the last 256 steps with a constrained row: that mix's own when
it ran at least that many, as 2 x concurrency requests of 128 tokens do).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stack.bench.served import server_stats  # noqa: E402
from stack.bench.stacks import jaxstream_up  # noqa: E402

SCHEMA = {"type": "array", "minItems": 1000,
          "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                     "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                                     "city": {"enum": ["Paris", "Lyon", "Rome", "Oslo"]}},
                    "required": ["name", "age", "city"], "additionalProperties": False}}
TOPICS = ["a chess club", "a football team", "a choir", "a book club", "a startup", "a family", "a hiking group", "a class"]


def worker_stats(base_url: str) -> dict:
    """The stack's one worker's stats."""
    return next(iter(server_stats(base_url).get("worker", {}).values()), {})


def body(i: int, constrained: bool, output_len: int) -> dict:
    request = {"model": "default", "max_tokens": output_len, "temperature": 0.8, "seed": i,
               "messages": [{"role": "user", "content": f"List the members of {TOPICS[i % len(TOPICS)]} as JSON objects with name, age and city."}]}
    if constrained:
        request["response_format"] = {"type": "json_schema", "json_schema": {"name": "members", "schema": SCHEMA}}
    else:
        request["ignore_eos"] = True
    return request


async def run_mix(base_url: str, concurrency: int, constrained: int, output_len: int) -> float:
    """Output tokens/s of 2 x concurrency requests, `concurrency` at a time, `constrained` of each wave constrained."""
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        async def one(i: int) -> int:
            r = await client.post("/v1/chat/completions", json=body(i, i % concurrency < constrained, output_len))
            r.raise_for_status()
            out = r.json()
            assert out["choices"][0]["finish_reason"] == "length", out["choices"][0]
            return out["usage"]["completion_tokens"]

        started = time.perf_counter()
        tokens = 0
        for wave in range(2):
            tokens += sum(await asyncio.gather(*(one(wave * concurrency + i) for i in range(concurrency))))
        return tokens / (time.perf_counter() - started)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="for `jaxstream up`, e.g. scheduler.max_running_requests=64")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mixes", default="0,4,32", help="how many of the concurrent streams are constrained, per mix")
    args = ap.parse_args()
    mixes = [int(m) for m in args.mixes.split(",")]
    with jaxstream_up(list(args.overrides)) as url:
        asyncio.run(run_mix(url, args.concurrency, max(mixes), 16))  # warm-up: first requests, the schema compiled once
        rates: dict[int, list[float]] = {m: [] for m in mixes}
        masks: dict[int, list[str]] = {m: [] for m in mixes}
        for r in range(args.rounds):
            for m in mixes:
                rates[m].append(asyncio.run(run_mix(url, args.concurrency, m, args.output_len)))
                stats = worker_stats(url)
                if m:
                    masks[m].append(f"{stats.get('constraint_mask_ms_p50', '-')}/{stats.get('constraint_mask_ms_p99', '-')}")
                print(f"round {r + 1}: {m:>3} of {args.concurrency} constrained: {rates[m][-1]:7.1f} output tok/s"
                      + (f", mask ms p50/p99 {masks[m][-1]}" if m else ""), flush=True)
        base = statistics.median(rates[mixes[0]])
        print(f"\n{args.concurrency} streams x {args.output_len} tokens, {args.rounds} rounds; median output tok/s, ratio to {mixes[0]} constrained")
        print(f"{'constrained':>11} {'tok/s':>8} {'ratio':>6}  mask ms p50/p99 per round")
        for m in mixes:
            median = statistics.median(rates[m])
            print(f"{m:>11} {median:8.1f} {median / base:6.3f}  {' '.join(masks[m]) or '-'}")
        print("\nworker:", json.dumps({k: v for k, v in worker_stats(url).items() if k.startswith(("constraint", "step_ms", "compiles"))}))


if __name__ == "__main__":
    main()
