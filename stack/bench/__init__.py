"""`jaxstream bench`: a load generator for OpenAI-compatible servers, and the same load on the
worker engine alone, to compare them.

1. Parse and check every flag (`options.py`); a conversations file is read here too.
2. Make the targets: each URL a server loaded over HTTP (`served.py`); each --serve a `jaxstream
   up` stack on a free port, loaded the same way (`stacks.py`); --in-process the engine of the
   Hydra config in this process (`inprocess.py`). Every config is composed here, before anything starts.
3. Start the --serve stacks together and wait until each answers /health; from here on, however
   the benchmark ends (done, an error, Ctrl-C), they are stopped at its end.
4. Prepare each target: find its model, probe that it takes the request (a refused extension is
   dropped), build the engine, warm up.
5. For each load value, each round, each target in turn (A, B, A, B, ...): the same requests
   (`load.py`: drawn anew per round, seeded) and the same arrival times, one run each, so the
   machine's drift touches the targets alike. Then, with --stats, each target's /stats (`stats.py`).
6. Figures per run, then per (target, load) the median over rounds, and the ratio of output
   throughput to the reference target's in the same round (`figures.py`).
7. Print the table (and the pipeline tax, served / in-process; the chosen /stats), write the JSON
   and the plot (`report.py`). Exit 0, or 1 when a request failed.
"""

from __future__ import annotations

import datetime
import sys
from dataclasses import replace

from stack.bench import load, stats
from stack.bench.figures import Run, figures, short_outputs, summarize
from stack.bench.load import Request, Schedule
from stack.bench.options import Options, parse
from stack.bench.report import load_label, load_text, plot, table, write_json
from stack.bench.served import BenchError, ServedTarget, target_names
from stack.bench.stacks import Server, running, serve_names, up_server
from jaxstream.config import ConfigError

IN_PROCESS = "in-process"
WARMUP_KEY = 1 << 20  # the warm-up requests' seed key, apart from every (load, round)
PREFIX_KEY = WARMUP_KEY + 1  # the shared prefix's: one for the whole benchmark


def say(message: str) -> None:
    print(f"jaxstream bench: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        opts = parse(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return int(exc.code or 0)
    try:
        return bench(opts, argv)
    except ConfigError as exc:
        say(f"config error: {exc}")
        return 2
    except BenchError as exc:
        say(str(exc))
        return 1
    except KeyboardInterrupt:
        say("interrupted")
        return 130


def make_targets(opts: Options) -> tuple[list, list[Server]]:
    """The targets in order (--base-url, --compare-url, each --serve, --in-process), and the
    servers to start for the --serve ones."""
    urls = [u for u in (opts.base_url, opts.compare_url) if u]
    targets: list = [ServedTarget(name, url, opts.model, opts.temperature, opts.extra_body, opts.timeout)
                     for name, url in zip(target_names(urls), urls)]
    servers = []
    for name, own in zip(serve_names(opts.serves), opts.serves):
        overrides = [*opts.overrides, *own]
        servers.append(up_server(name, overrides))
        targets.append(ServedTarget(name, servers[-1].url, opts.model, opts.temperature, opts.extra_body, opts.timeout,
                                    overrides=overrides))
    if opts.in_process:
        from stack.bench.inprocess import InProcessTarget

        targets.append(InProcessTarget(IN_PROCESS, opts.overrides, opts.temperature, opts.extra_body))
    return targets, servers


def requests_for(opts: Options, n: int, *key: int) -> list[Request]:
    if opts.conversations is not None:
        return load.from_conversations(opts.conversations, n, opts.output_len)
    prefix = (load.shared_prefix(opts.shared_prefix_len, opts.prompt_format, load.rng_for(opts.seed, PREFIX_KEY))
              if opts.shared_prefix_len else None)
    return load.synthetic(n, opts.input_len, opts.output_len, opts.prompt_format, load.rng_for(opts.seed, *key), prefix)


def schedule_for(opts: Options, value: float, *key: int) -> Schedule:
    if opts.mode == "concurrency":
        return Schedule(concurrency=int(value))
    return Schedule(arrivals=load.poisson_arrivals(opts.num_prompts, value, load.rng_for(opts.seed, *key, 1)))


def bench(opts: Options, argv: list[str]) -> int:
    targets, servers = make_targets(opts)  # a bad override fails here, before anything starts
    with running(servers, opts.serve_timeout, say):
        runs = measure(opts, targets)
        chosen = stats.selected({t.name: t.stats() for t in targets}, opts.stats) if opts.stats else {}
    return report(opts, argv, targets, runs, chosen)


def measure(opts: Options, targets: list) -> list[Run]:
    """Prepare each target, then for each load value and round the same requests to each in turn."""
    warmup = requests_for(opts, max(opts.warmup, 1), WARMUP_KEY)
    probe = replace(warmup[0], max_tokens=min(2, warmup[0].max_tokens))
    for target in targets:
        say(f"preparing {target.name}")
        target.prepare(probe, warmup[: opts.warmup])
    runs: list[Run] = []
    for li, value in enumerate(opts.loads):
        for rnd in range(opts.rounds):
            requests = requests_for(opts, opts.num_prompts, li, rnd)
            schedule = schedule_for(opts, value, li, rnd)
            for target in targets:
                run = target.run(requests, schedule, value, rnd)
                runs.append(run)
                f = figures(run)
                say(f"{target.name} {load_label(opts.mode)}={load_text(value)} round {rnd + 1}/{opts.rounds}: "
                    f"{f['completed']}/{f['requests']} requests in {run.duration_s:.1f} s, "
                    f"{f['output_throughput']:.1f} output tok/s")
    return runs


def report(opts: Options, argv: list[str], targets: list, runs: list[Run], chosen: dict) -> int:
    """Print the tables, write the files; the exit code."""
    names = [t.name for t in targets]
    served = [t.name for t in targets if t.kind == "http"]
    reference = (IN_PROCESS if opts.in_process and served else names[0]) if len(names) > 1 else None
    rows = summarize(runs, names, opts.loads, reference)
    taxes = [{"served": r.target, "load": r.load, "ratio": r.ratio} for r in rows
             if reference == IN_PROCESS and r.target in served]
    shared = f"a {opts.shared_prefix_len}-token shared prefix + " if opts.shared_prefix_len else ""
    what = (f"{len(opts.conversations)} conversations" if opts.conversations is not None
            else f"{shared}{opts.input_len} prompt tokens ({opts.prompt_format})")
    print(f"{opts.num_prompts} requests per run, {what}, {opts.output_len} output tokens asked, "
          f"{opts.rounds} round{'s' * (opts.rounds > 1)}{' (medians)' if opts.rounds > 1 else ''}")
    print(table(rows, opts.mode, reference is not None))
    if reference is not None:
        print(f"ratio: output tok/s / {reference}'s, median over rounds")
    for tax in taxes:
        print(f"pipeline tax at {load_label(opts.mode)} {load_text(tax['load'])}: {tax['served']} serves "
              f"{_ratio(tax['ratio'])} of the in-process output throughput")
    if chosen:
        print(f"\n{stats.table(chosen)}")
    if opts.conversations is None:
        for name in names:
            short, done = short_outputs(runs, name, opts.output_len)
            if short:
                say(f"{name}: {short} of {done} completed requests ended before {opts.output_len} output tokens "
                    "(a server that ignores ignore_eos and min_tokens stops at its end token): its figures are of "
                    "fewer tokens; the JSON has each request's count")
    failed = sum(1 for run in runs for r in run.records if not r.ok)
    if opts.json_path:
        meta = {"command": ["jaxstream", "bench", *argv], "started": datetime.datetime.now().isoformat(timespec="seconds"),
                "options": opts.as_dict(), "targets": [t.describe() for t in targets], "reference": reference,
                "definitions": DEFINITIONS, "stats": chosen}
        write_json(opts.json_path, meta, rows, runs, taxes)
        say(f"wrote {opts.json_path}")
    if opts.plot_path:
        plot(opts.plot_path, rows, opts.mode, f"jaxstream bench: {what}, {opts.output_len} output tokens")
        say(f"wrote {opts.plot_path}")
    if failed:
        first = next(r.error for run in runs for r in run.records if not r.ok)
        say(f"{failed} requests failed; the first: {first}")
        return 1
    return 0


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


DEFINITIONS = {
    "ttft": "first content chunk - request sent (in-process: submitted to the scheduler; a token: its step returned)",
    "itl": "gaps between consecutive content chunks of a stream, pooled over the run's completed requests; "
           "a chunk counts once however many tokens it holds (vLLM's benchmark_serving definition)",
    "tpot": "per request (E2E - TTFT) / (output tokens - 1)",
    "e2e": "end of the stream - request sent",
    "throughput": "tokens of completed requests / the run's wall time (first request sent .. last one ended); "
                  "token counts from the server's usage, else content chunks (output) and the drawn length (prompt)",
    "rows": "each figure the median over rounds; ratio the median over rounds of output_throughput / the reference's",
}
