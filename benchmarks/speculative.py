"""n-gram speculative decoding on and off at batch 1, per workload: decode speed on copy-heavy and
on novel text, served side by side, and whether the outputs are the same.

    python benchmarks/speculative.py [OVERRIDES...] [--rounds 3] [--max-tokens 256] [--show] [--workloads ...]

Starts two stacks (`jaxstream up` with the OVERRIDES: the JAX worker on the bundled model unless
one says otherwise), A with scheduler.speculative=ngram and B with none, then, per workload, sends
its prompt to each in alternation, one request at a time, --rounds times: a streamed chat
completion, greedy or sampled with seed 1, ending where the model ends it (or at --max-tokens).
Decode tokens/s is the completion's tokens after the first over the time after the first (1 /
TPOT). Prints per workload the median of each and their ratio, whether every text of both stacks
is the same (it must be: drafts change the steps, not the tokens), and the drafts' acceptance over
the workload's requests (A's /stats); then each worker's compiled shapes and its compiles after
start-up (there must be none).

The same two stacks under a concurrent load are one `jaxstream bench --serve ... --serve ...`
command (benchmarks/README.md); this script is the batch-1 workloads and the text check, built on
its Python API.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stack.bench import stats  # noqa: E402
from stack.bench.figures import figures  # noqa: E402
from stack.bench.load import Request, Schedule  # noqa: E402
from stack.bench.served import ServedTarget, server_stats  # noqa: E402
from stack.bench.stacks import Server, running, up_server  # noqa: E402

READY_TIMEOUT_S = 900  # the JAX worker compiles its step shapes before /health answers
# Each request ends where the model ends it, as a user's would (bench's default asks for exactly
# max_tokens); sampled ones with a seed, so both stacks sample the same tokens.
AS_A_USER = {"ignore_eos": False, "min_tokens": 0, "seed": 1}
DRAFT_COUNTERS = ("scheduler.spec_decode_num_draft_tokens_total", "scheduler.spec_decode_num_accepted_tokens_total")

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



def say(message: str) -> None:
    print(f"speculative: {message}", file=sys.stderr, flush=True)


def drafts(target: ServedTarget) -> list[int]:
    """The draft tokens verified and accepted so far, over the stack's schedulers."""
    counters = target.stats()
    return [sum(stats.values(counters, field)) for field in DRAFT_COUNTERS]


def workload(name: str, servers: list[Server], args: argparse.Namespace) -> str:
    """The workload's line of the table (and its text with --show)."""
    prompt, temperature = WORKLOADS[name]
    request = Request(args.max_tokens, messages=(("user", prompt),))
    on, off = targets = [ServedTarget(s.name, s.url, None, temperature, AS_A_USER, timeout=600) for s in servers]
    for target in targets:  # warm: the first request of a shape pays for nothing else after start-up
        target.prepare(replace(request, max_tokens=2), [replace(request, max_tokens=8)])
    before = drafts(on)
    rates: dict[str, list[float]] = {t.name: [] for t in targets}
    texts: dict[str, set[str]] = {t.name: set() for t in targets}
    tokens = 0
    for rnd in range(args.rounds):
        for target in targets:
            run = target.run([request], Schedule(concurrency=1), 1, rnd)
            (record,) = run.records
            if not record.ok:
                sys.exit(f"speculative: {target.name}: {record.error}")
            tpot = figures(run)["tpot_p50_ms"]
            rates[target.name].append(1000 / tpot if tpot else float("nan"))
            texts[target.name].add(record.text)
            tokens = record.output_tokens
    drafted, accepted = (after - was for after, was in zip(drafts(on), before))
    a, b = (statistics.median(rates[t.name]) for t in targets)
    same = len(texts[on.name] | texts[off.name]) == 1
    line = (f"{name:<12} {tokens:>6} {a:>8.1f} {b:>8.1f} {a / b:>6.2f}  {str(same):<9}  "
            f"{accepted}/{drafted} = {accepted / max(drafted, 1):.2f}   rounds A {[round(r, 1) for r in rates[on.name]]}, "
            f"B {[round(r, 1) for r in rates[off.name]]}")
    return line + (f"\n    {next(iter(texts[on.name]))[:400]!r}" if args.show else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="for both `jaxstream up`s")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--show", action="store_true", help="print the start of each workload's text")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    args = ap.parse_args()
    if args.rounds < 1 or args.max_tokens < 2:
        ap.error("--rounds must be >= 1 and --max-tokens >= 2")
    servers = [up_server(f"{name} (scheduler.speculative={method})", [*args.overrides, f"scheduler.speculative={method}"])
               for name, method in (("A", "ngram"), ("B", "none"))]
    with running(servers, READY_TIMEOUT_S, say):
        print(f"A = scheduler.speculative=ngram, B = none; batch 1, max_tokens {args.max_tokens}")
        print(f"{'workload':<12} {'tokens':>6} {'A tok/s':>8} {'B tok/s':>8} {'A / B':>6}  same text  A's acceptance")
        for name in args.workloads:
            print(workload(name, servers, args), flush=True)
        for server in servers:
            counters = server_stats(server.url)
            shapes, compiles = (" / ".join(map(str, stats.values(counters, f"worker.{key}"))) or "-"
                                for key in ("compiled_shapes", "compiles_after_ready"))
            print(f"{server.name}: {shapes} compiled shapes, {compiles} compiles after start-up")


if __name__ == "__main__":
    main()
