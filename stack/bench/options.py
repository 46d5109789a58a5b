"""`jaxstream bench`'s command line: every flag checked before anything runs, so a mistake costs
seconds, not a benchmark. A bad flag is argparse's usage error (exit 2), never a traceback."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from stack.bench.load import ConversationError, Conversation, read_conversations
from stack.bench.stacks import OWN_KEYS
from stack.bench.stats import pattern_error

DEFAULT_URL = "http://127.0.0.1:8000"

DESCRIPTION = """\
Load an OpenAI-compatible server over HTTP (jaxstream, vLLM, SGLang, llama.cpp, ...) with
streaming completions, and report throughput and latency. Or run the same load on jaxstream's
worker engine alone, in this process (--in-process), to see what the services and the wire cost.

Load: --num-prompts requests per run, at a fixed --concurrency (a closed loop: a new request as
soon as one ends; a comma list is a sweep, one run per value) or arriving at a Poisson
--request-rate (requests/s, seeded). Requests are synthetic prompts of --input-len tokens asking
for exactly --output-len tokens (max_tokens, ignore_eos and min_tokens; a server that refuses an
extension is sent the request without it, and the actual counts are reported), or the chats of a
--conversations file sent to /v1/chat/completions. With --shared-prefix-len N every synthetic
prompt (the warm-up's too) starts with the same N tokens, then has --input-len of its own.

Targets, run in alternation (A, B, A, B, ... --rounds times per load value): --base-url, then
--compare-url, then each --serve, then --in-process. With several targets the table has a ratio
column: output tok/s over the reference's (the in-process engine when there is one, else the
first target); served / in-process is the pipeline tax.

Stacks: each --serve "OVERRIDES" starts `jaxstream up` with the shared OVERRIDEs (the positional
ones) and its own, on 127.0.0.1 and a free port, waits for its /health, and stops it at the end
(on an error or Ctrl-C too): a side-by-side of configurations is one command. A stack is named
by its own overrides that not every --serve has. The positional OVERRIDEs configure the
--in-process engine too. --stats prints chosen fields of each target's /stats after the run
(jaxstream's: ROLE.KEY, e.g. worker.idle_gap_ms_p50 or scheduler.spec_decode_acceptance_rate).

Figures, per run (medians over rounds in the table):
  TTFT   first content chunk - request sent
  ITL    gaps between consecutive content chunks of a stream, pooled over the run's requests
         (vLLM's benchmark_serving definition: a chunk counts once, however many tokens it holds;
         jaxstream streams one chunk per token). TPOT in the JSON is the per-token figure:
         (E2E - TTFT) / (output tokens - 1) per request.
  E2E    end of the stream - request sent
  tok/s  output tokens (and prompt + output tokens) of completed requests / the run's wall time;
         token counts from the server's usage (stream_options.include_usage), else the chunks.
In-process, a request is sent when the scheduler takes it and a token arrives when its step ends.

Conversations file: a JSON list; each entry is one chat request, either
  {"messages": [{"role": "user", "content": "..."}, ...], "max_tokens": 64}   (max_tokens optional)
or ShareGPT's {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}, ...]}
(from: system, human/user, gpt/assistant). Trailing assistant turns are dropped (they are the
reference answer); each request asks for --output-len tokens unless its entry says max_tokens.
Entries are taken in file order, cycling when --num-prompts exceeds them.
"""

EPILOG = """\
examples:
  jaxstream bench --base-url http://127.0.0.1:8000 --concurrency 1,8,32 --input-len 128 --output-len 128
  jaxstream bench --request-rate 2 --num-prompts 100 --json out.json --plot out.png
  jaxstream bench --base-url http://127.0.0.1:8000 --compare-url http://127.0.0.1:8001 --rounds 3
  jaxstream bench --in-process model=smollm2 --concurrency 32 --prompt-format ids
  jaxstream bench --base-url http://127.0.0.1:8000 --in-process --concurrency 32 --prompt-format ids
  jaxstream bench --serve scheduler.overlap=true --serve scheduler.overlap=false --stats 'worker.idle_gap_ms_*'
  jaxstream bench worker=fake --serve scheduler.prefix_cache=true --serve scheduler.prefix_cache=false --shared-prefix-len 512
"""


@dataclass
class Options:
    base_url: str | None  # None: no HTTP target (--in-process alone)
    compare_url: str | None
    in_process: bool
    overrides: list[str]  # Hydra overrides shared by the --serve stacks and the in-process engine
    serves: list[list[str]]  # each --serve stack's own overrides
    serve_timeout: float
    mode: str  # "concurrency" or "rate"
    loads: list[float]  # concurrency values, or request rates
    num_prompts: int
    rounds: int
    warmup: int
    input_len: int
    shared_prefix_len: int
    output_len: int
    prompt_format: str  # "text" or "ids"
    conversations: list[Conversation] | None
    conversations_path: str | None
    model: str | None
    temperature: float
    extra_body: dict = field(default_factory=dict)
    seed: int = 0
    timeout: float = 600.0
    stats: list[str] = field(default_factory=list)  # ROLE.KEY patterns
    json_path: Path | None = None
    plot_path: Path | None = None

    def as_dict(self) -> dict:
        skip = {"conversations", "json_path", "plot_path"}
        out = {k: v for k, v in vars(self).items() if k not in skip}
        out.update(json=str(self.json_path) if self.json_path else None, plot=str(self.plot_path) if self.plot_path else None)
        return out


def _positive_list(text: str, parse, kind: str, rule: str) -> list:
    """A comma-separated list of finite values > 0, or an argparse error naming what was wrong."""
    try:
        values = [parse(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind}, got {text!r}") from None
    if not values or not all(0 < v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"every value must be {rule}, got {text!r}")
    return values


def positive_ints(text: str) -> list[int]:
    return _positive_list(text, int, "integers", ">= 1")


def positive_floats(text: str) -> list[float]:
    return _positive_list(text, float, "numbers", "a finite number > 0")


def stat_fields(text: str) -> list[str]:
    fields = [f.strip() for f in text.split(",")]
    for f in fields:
        if (error := pattern_error(f)) is not None:
            raise argparse.ArgumentTypeError(error)
    return fields


def bounded(kind: type, least: float, inclusive: bool = True):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if value < least or (not inclusive and value == least):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {least}, got {text}")
        return value
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxstream bench", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    targets = p.add_argument_group("targets")
    targets.add_argument("--base-url", help=f"the server to load (default {DEFAULT_URL}, unless --in-process alone)")
    targets.add_argument("--compare-url", help="a second server, loaded in alternation with --base-url")
    targets.add_argument("--serve", action="append", default=[], metavar='"OVERRIDES"',
                         help="start `jaxstream up` with these Hydra overrides (one argument, after the shared "
                              "OVERRIDEs) and load it; once per configuration to compare")
    targets.add_argument("--serve-timeout", type=bounded(float, 0, inclusive=False), default=900.0, metavar="SECONDS",
                         help="how long a --serve stack may take to answer /health "
                              "(default 900: the JAX worker compiles its step shapes first)")
    targets.add_argument("--in-process", action="store_true",
                         help="also (or, without --base-url, only) run the load on the worker engine in this process, "
                              "configured by the Hydra overrides")
    targets.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                         help="Hydra overrides, as for `jaxstream up` (model=qwen3_tiny ...), shared by every --serve "
                              "stack and the --in-process engine")
    targets.add_argument("--model", help="the model name sent to the servers (default: each server's first /v1/models)")
    load = p.add_argument_group("load")
    rate = load.add_mutually_exclusive_group()
    rate.add_argument("--concurrency", type=positive_ints, metavar="N[,N...]",
                      help="requests in flight, a closed loop; a list is a sweep (default 8)")
    rate.add_argument("--request-rate", type=positive_floats, metavar="R[,R...]",
                      help="Poisson arrivals at R requests/s (seeded); a list is a sweep")
    load.add_argument("--num-prompts", type=bounded(int, 1), default=64, help="requests per run (default 64)")
    load.add_argument("--rounds", type=bounded(int, 1),
                      help="runs per load value and target, alternating targets (default 1; 3 with several targets)")
    load.add_argument("--warmup", type=bounded(int, 0), default=1,
                      help="requests sent to each target before measuring (default 1)")
    load.add_argument("--input-len", type=bounded(int, 1),
                      help="prompt tokens of a synthetic request, after the shared prefix (default 128)")
    load.add_argument("--shared-prefix-len", type=bounded(int, 0), metavar="N",
                      help="every synthetic prompt starts with the same N tokens, as a shared system prompt would "
                           "(default 0)")
    load.add_argument("--output-len", type=bounded(int, 1), default=128, help="output tokens asked per request (default 128)")
    load.add_argument("--prompt-format", choices=("text", "ids"),
                      help="synthetic prompts as text of random words, about one token each (default: portable), "
                           "or as token-id lists (exact; jaxstream, vLLM)")
    load.add_argument("--conversations", metavar="FILE", help="chat requests from a JSON file (format above)")
    load.add_argument("--temperature", type=bounded(float, 0), default=0.0, help="sampling temperature (default 0: greedy)")
    load.add_argument("--extra-body", metavar="JSON", default="{}", help="fields added to every request body")
    load.add_argument("--seed", type=int, default=0, help="of the prompts and the arrivals (default 0)")
    load.add_argument("--timeout", type=bounded(float, 0, inclusive=False), default=600.0,
                      help="seconds a request may take (default 600)")
    out = p.add_argument_group("output")
    out.add_argument("--stats", type=stat_fields, default=[], metavar="ROLE.KEY[,...]",
                     help="after the run, print these fields of each target's /stats side by side; KEY may hold "
                          "* and ? (worker.idle_gap_ms_*)")
    out.add_argument("--json", metavar="FILE", help="write every figure and each request's timings")
    out.add_argument("--plot", metavar="FILE", help="draw throughput and latency against the load (PNG; needs matplotlib)")
    return p


def parse(argv: list[str]) -> Options:
    """The checked options; argparse's exit (2, with usage) on anything wrong."""
    p = parser()
    a = p.parse_intermixed_args(argv)
    for o in a.overrides:
        if not _is_override(o):
            p.error(f"unrecognized argument {o!r} (Hydra overrides look like key=value, e.g. model=qwen3_tiny)")
    if a.overrides and not (a.in_process or a.serve):
        p.error("Hydra overrides configure the --in-process engine and the --serve stacks; a server at a URL is "
                f"configured where it runs (got {' '.join(a.overrides)} without --in-process or --serve)")
    serves = [_serve(p, text) for text in a.serve]
    for o in [*a.overrides, *(o for own in serves for o in own)] if serves else []:
        if o.split("=", 1)[0].lstrip("+~") in OWN_KEYS:
            p.error(f"{o}: jaxstream bench starts each --serve stack on 127.0.0.1 and a free port of its choosing")
    for flag, url in (("--base-url", a.base_url), ("--compare-url", a.compare_url)):
        if url is not None and not url.startswith(("http://", "https://")):
            p.error(f"{flag}: expected an http:// or https:// URL, got {url!r}")
    base_url = a.base_url or (None if (a.in_process or serves) and not a.compare_url else DEFAULT_URL)
    conversations = None
    if a.conversations is not None:
        for flag, value in (("--input-len", a.input_len), ("--prompt-format", a.prompt_format),
                            ("--shared-prefix-len", a.shared_prefix_len)):
            if value is not None:
                p.error(f"{flag} shapes synthetic prompts; --conversations brings its own")
        try:
            conversations = read_conversations(Path(a.conversations))
        except ConversationError as exc:
            p.error(f"--conversations: {exc}")
    try:
        extra = json.loads(a.extra_body)
    except json.JSONDecodeError as exc:
        p.error(f"--extra-body: not valid JSON ({exc.msg} at position {exc.pos})")
    if not isinstance(extra, dict):
        p.error("--extra-body: must be a JSON object")
    for flag, path in (("--json", a.json), ("--plot", a.plot)):
        if path is not None and not Path(path).expanduser().resolve().parent.is_dir():
            p.error(f"{flag}: the directory of {path!r} does not exist")
    if a.plot is not None and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib: pip install matplotlib (or 'jaxstream[bench]')")
    targets = (base_url is not None) + (a.compare_url is not None) + len(serves) + a.in_process
    return Options(
        base_url=_root(base_url),
        compare_url=_root(a.compare_url),
        in_process=a.in_process,
        overrides=list(a.overrides),
        serves=serves,
        serve_timeout=a.serve_timeout,
        mode="rate" if a.request_rate else "concurrency",
        loads=a.request_rate or a.concurrency or [8],
        num_prompts=a.num_prompts,
        rounds=a.rounds or (3 if targets > 1 else 1),
        warmup=a.warmup,
        input_len=a.input_len or 128,
        shared_prefix_len=a.shared_prefix_len or 0,
        output_len=a.output_len,
        prompt_format=a.prompt_format or "text",
        conversations=conversations,
        conversations_path=a.conversations,
        model=a.model,
        temperature=a.temperature,
        extra_body=extra,
        seed=a.seed,
        timeout=a.timeout,
        stats=a.stats,
        json_path=Path(a.json).expanduser() if a.json else None,
        plot_path=Path(a.plot).expanduser() if a.plot else None,
    )


def _is_override(text: str) -> bool:
    return "=" in text and not text.startswith("-")


def _serve(p: argparse.ArgumentParser, text: str) -> list[str]:
    """A --serve's overrides: one argument, split as a shell would ('' is the shared overrides alone)."""
    try:
        own = shlex.split(text)
    except ValueError as exc:
        p.error(f"--serve {text!r}: {exc}")
    for o in own:
        if not _is_override(o):
            p.error(f"--serve {text!r}: {o!r} is not a Hydra override (key=value, e.g. scheduler.overlap=false)")
    return own


def _root(url: str | None) -> str | None:
    """The server's root: an OpenAI base URL (…/v1) is accepted too."""
    return url.rstrip("/").removesuffix("/v1") if url else None
