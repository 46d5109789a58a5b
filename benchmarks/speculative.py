"""n-gram speculative decoding on and off, side by side: batch-1 decode speed on copy-heavy and on
novel text, served.

    python benchmarks/speculative.py [OVERRIDES...] [--rounds 3] [--max-tokens 256]

Starts two stacks (`jaxstream up`, the JAX worker on the bundled model unless an override says
otherwise), one with scheduler.speculative=ngram and one without, then sends each workload's
prompt to each in alternation, one request at a time (streamed; greedy, or sampled with a seed):
decode tokens/s is the completion's tokens after the first over the time from the first to the
last. Prints the median of each and their ratio, whether the two texts are equal (they must be:
drafts change the steps, not the tokens), and the drafts' acceptance from the speculative stack's
/stats; with --concurrency, `jaxstream bench` side by side under load; then each worker's compiled
shapes and compiles since start-up (there must be none).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import httpx

from serving import ROOT, jaxstream_up

PASSAGE = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips. Every evening the keeper "
    "climbed the one hundred and twelve steps to light the lamp, and every morning he climbed them again to put it out. "
    "Ships passing in the night saw the beam sweep across the water and knew that the rocks were near. The keeper had a "
    "cat named Pepper who followed him up the stairs and slept beside the lamp while it turned. In winter the wind "
    "howled around the tower and the waves threw spray as high as the gallery, but the light never failed."
)
CODE = '''def compute_total(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def print_receipt(items, tax_rate):
    for item in items:
        print(f"{item.name}: {item.price * item.quantity:.2f}")
    print(f"Total: {compute_total(items, tax_rate):.2f}")
'''
WORKLOADS = {  # name: (prompt, temperature; a sampled one with seed 1)
    "copy": (f"Repeat the following passage exactly, but write 'dog' instead of 'cat':\n\n{PASSAGE}", 0.0),
    "code edit": (f"Here is some Python code:\n\n{CODE}\nRewrite this code with the function compute_total renamed to order_total.", 0.0),
    "explain": ("Explain how a rainbow forms, in detail.", 0.0),
    "story, T=0.7": ("Write a short story about a dragon who learns to paint.", 0.7),
}


def decode_rate(base_url: str, prompt: str, temperature: float, max_tokens: int) -> tuple[float, int, str]:
    """(decode tokens/s, completion tokens, text) of one streamed chat completion (seed 1)."""
    body = {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "seed": 1, "stream": True, "stream_options": {"include_usage": True}}
    times, text, tokens = [], [], 0
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
                text.append(chunk["choices"][0]["delta"]["content"])
    return (tokens - 1) / (times[-1] - times[0]), tokens, "".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="for both `jaxstream up`s")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--show", action="store_true", help="print the start of each workload's text")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--concurrency", type=int, default=0,
                    help="then also load both with `jaxstream bench` at this many streams (128 in / 128 out, 64 prompts)")
    args = ap.parse_args()
    with jaxstream_up(["scheduler.speculative=ngram", *args.overrides]) as on, jaxstream_up(args.overrides) as off:
        print(f"A = scheduler.speculative=ngram ({on}), B = none ({off}); batch 1, max_tokens {args.max_tokens}")
        print(f"{'workload':<12} {'tokens':>6} {'A tok/s':>8} {'B tok/s':>8} {'A / B':>6}  same text  A's acceptance")
        for name in args.workloads:
            prompt, temperature = WORKLOADS[name]
            for url in (on, off):  # warm: the first request of a shape pays for nothing else after start-up
                decode_rate(url, prompt, temperature, 8)
            before = httpx.get(on + "/stats", timeout=10).json()["scheduler"]
            rates: dict[str, list[float]] = {on: [], off: []}
            texts: dict[str, str] = {}
            tokens = 0
            for _ in range(args.rounds):
                for url in (on, off):
                    rate, tokens, texts[url] = decode_rate(url, prompt, temperature, args.max_tokens)
                    rates[url].append(rate)
            after = httpx.get(on + "/stats", timeout=10).json()["scheduler"]
            drafted, accepted = (sum(s.get(key, 0) for s in after.values()) - sum(s.get(key, 0) for s in before.values())
                                 for key in ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total"))
            a, b = statistics.median(rates[on]), statistics.median(rates[off])
            print(f"{name:<12} {tokens:>6} {a:>8.1f} {b:>8.1f} {a / b:>6.2f}  {str(texts[on] == texts[off]):<9}  "
                  f"{accepted}/{drafted} = {accepted / max(drafted, 1):.2f}   rounds A {[round(r, 1) for r in rates[on]]}, "
                  f"B {[round(r, 1) for r in rates[off]]}", flush=True)
            if args.show:
                print("   ", repr(texts[on][:400]))
        if args.concurrency:
            subprocess.run([sys.executable, "-m", "stack", "bench", "--base-url", on, "--compare-url", off, "--concurrency",
                            str(args.concurrency), "--input-len", "128", "--output-len", "128", "--num-prompts", "64",
                            "--rounds", str(args.rounds)], cwd=ROOT, check=True)
        for name, url in (("A", on), ("B", off)):
            (worker,) = httpx.get(url + "/stats", timeout=10).json()["worker"].values()
            print(f"{name}: {worker['compiled_shapes']} compiled shapes, {worker['compiles_after_ready']} compiles after start-up")


if __name__ == "__main__":
    main()
