"""The `jaxstream` command.

    jaxstream up [hydra overrides...]     run the whole stack in the foreground
    jaxstream config [hydra overrides...] print the composed config
    jaxstream bench [options...]          load a server (or the engine in process) and report

`python -m stack ...` is the same command, for a checkout without the console script.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from jaxstream.config import AppConfig, ConfigError, load_config, reference

USAGE = """usage: jaxstream up [--restart=always|never] [overrides...]
       jaxstream config [overrides...]
       jaxstream bench [options...] [overrides...]

  up     run the whole stack (gateway, tokenizer, scheduler, worker, detokenizer; a scheduler
         and a worker per data-parallel replica) in the foreground, with an embedded
         redis-server unless redis.url is set.
         Overrides are Hydra's: model=smollm2 worker=fake server.port=8001 scheduler.page_size=32
         parallelism=dp2. `jaxstream up --help` lists every config group and key.
         A service that dies is restarted (a replica's scheduler and worker together, with a
         back-off; a crash loop stops the stack); --restart=never stops the stack instead.
  config print the config those overrides compose (YAML), as `up` would run it, and the
         cache's memory (KV pages; a hybrid's recurrent states) as a comment after it.
  bench  load an OpenAI-compatible server (--base-url, default http://127.0.0.1:8000) with
         streaming requests at a concurrency or a request rate, and report throughput, TTFT,
         ITL and end-to-end latency; --serve "OVERRIDES" (once per configuration) starts a
         stack for each and compares them; --in-process [overrides...] runs the same load on
         the worker engine alone. `jaxstream bench --help` lists its options.
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "up":
        from stack.launcher import up

        return with_config("up", rest, up)
    if command == "config":
        return with_config("config", rest, print_config)
    if command == "bench":
        from stack.bench import main as bench

        return bench(rest)
    print(f"jaxstream: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


def with_config(command: str, overrides: list[str], run: Callable[[list[str]], int]) -> int:
    """`--help`: the config reference; else `run(overrides)`, a config error reported in one line."""
    if {"-h", "--help"} & set(overrides):
        print(f"usage: jaxstream {command} [overrides...]\n\n{reference()}")
        return 0
    try:
        return run(overrides)
    except ConfigError as exc:
        print(f"jaxstream: config error: {exc}", file=sys.stderr)
        return 2


def print_config(overrides: list[str]) -> int:
    from omegaconf import OmegaConf

    from jaxstream.keys import public_config

    from jaxstream.kv_memory import summary
    from jaxstream.preflight import model_numbers, preflight

    cfg: AppConfig = load_config(overrides)
    preflight(cfg)  # as `up` runs it: scheduler.num_pages is the pool scheduler.kv_cache_memory_gib holds
    print(OmegaConf.to_yaml(public_config(cfg)), end="")  # the Redis password masked
    try:
        print(f"# {summary(cfg, model_numbers(cfg)[1])}")
    except KeyError:  # a model whose numbers do not say (its pool given as scheduler.num_pages): nothing to add
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
