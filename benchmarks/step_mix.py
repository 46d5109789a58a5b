"""Where the engine's time goes under a serving load: `jaxstream bench --in-process`'s load (the
real scheduler core and the engine `jaxstream up` would build, no services), with every engine step
of the timed runs recorded, then summed by the step's compiled shapes (tokens T, pairs W, page-list
columns O; one per sub-step).

    python benchmarks/step_mix.py [OVERRIDES...] [--concurrency 32] [--input-len 128] [--output-len 128]
                                  [--num-prompts 64] [--rounds 1]

Prints the run's output tok/s, then per shape: steps, their summed and median milliseconds, and
the share of the engine's time. Warm-up steps are left out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stack.bench import load  # noqa: E402
from stack.bench.figures import figures  # noqa: E402
from stack.bench.inprocess import InProcessTarget  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for `jaxstream up`")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    target = InProcessTarget("in-process", args.overrides, 0.0, {})
    warmup = load.synthetic(1, args.input_len, 2, "ids", load.rng_for(args.seed, 99))
    target.prepare(warmup[0], warmup)
    engine = target.engine
    steps: list[tuple[tuple, float]] = []  # (the step's compiled shapes, its ms)
    serve = engine.step

    def step(*a, **k):
        result = serve(*a, **k)
        steps.append((tuple(engine.last_shapes), engine.last_step_ms))
        return result

    engine.step = step
    print(f"# {args.concurrency} streams, {args.num_prompts} requests of {args.input_len} prompt ids and "
          f"{args.output_len} output tokens, overrides {args.overrides or 'none'}")
    for rnd in range(args.rounds):
        requests = load.synthetic(args.num_prompts, args.input_len, args.output_len, "ids", load.rng_for(args.seed, rnd))
        run = target.run(requests, load.Schedule(concurrency=args.concurrency), args.concurrency, rnd)
        print(f"round {rnd + 1}: {run.duration_s:.1f} s, {figures(run)['output_throughput']:.1f} output tok/s")
    by_shape: dict[tuple, list[float]] = defaultdict(list)
    for shapes, ms in steps:
        by_shape[shapes].append(ms)
    total = sum(ms for _, ms in steps)
    print(f"{len(steps)} engine steps, {total / 1000:.1f} s")
    print(f"{'shapes (T, W, O)':<28} {'steps':>6} {'sum s':>7} {'median ms':>10} {'share':>6}")
    for shapes, times in sorted(by_shape.items(), key=lambda kv: -sum(kv[1])):
        label = " + ".join(str(s) for s in shapes)
        print(f"{label:<28} {len(times):>6} {sum(times) / 1000:>7.1f} {statistics.median(times):>10.1f} "
              f"{sum(times) / total:>6.1%}")


if __name__ == "__main__":
    main()
