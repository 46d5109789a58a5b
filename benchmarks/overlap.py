"""Overlap scheduling on and off, side by side: served throughput, latency and the worker's idle gap
between decode steps.

    python benchmarks/overlap.py [OVERRIDES...] [--concurrency 32] [--input-len 128] [--output-len 128]
                                 [--num-prompts 64] [--rounds 3]

Starts two stacks (`jaxstream up`, the JAX worker on the bundled model unless an override says
otherwise), one with scheduler.overlap=true and one with false, loads them in alternation with
`jaxstream bench` (its table compares them), then prints each worker's idle gaps from /stats: the
time from the end of one step to the start of the next that continues its requests (worker_svc/idle.py),
over the whole run (warm-up included).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import httpx

from serving import ROOT, jaxstream_up


def worker_stats(base_url: str) -> dict:
    workers = httpx.get(base_url + "/stats", timeout=10).json().get("worker", {})
    return next(iter(workers.values()), {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="for both `jaxstream up`s, e.g. scheduler.max_running_requests=64")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with jaxstream_up(["scheduler.overlap=true", *args.overrides]) as on, jaxstream_up(["scheduler.overlap=false", *args.overrides]) as off:
        print(f"A = {on} (scheduler.overlap=true), B = {off} (scheduler.overlap=false)", flush=True)
        subprocess.run([sys.executable, "-m", "stack", "bench", "--base-url", on, "--compare-url", off,
                        "--concurrency", str(args.concurrency), "--input-len", str(args.input_len),
                        "--output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
                        "--rounds", str(args.rounds)], cwd=ROOT, check=True)
        print("\nworker idle gap between decode steps (ms)")
        print(f"{'overlap':<8} {'gaps':>8} {'p50':>8} {'p90':>8} {'p99':>8}  step ms (last)")
        for name, url in (("true", on), ("false", off)):
            s = worker_stats(url)
            print(f"{name:<8} {s.get('idle_gaps', '0'):>8} {s.get('idle_gap_ms_p50', '-'):>8} {s.get('idle_gap_ms_p90', '-'):>8} "
                  f"{s.get('idle_gap_ms_p99', '-'):>8}  {s.get('step_ms', '-')}")


if __name__ == "__main__":
    main()
