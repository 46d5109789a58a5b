"""The `jaxstream` command.

    jaxstream up [hydra overrides...]     run the whole stack in the foreground
"""

from __future__ import annotations

import sys

from jaxstream.config import ConfigError

USAGE = """usage: jaxstream up [overrides...]

  up    run the whole stack (gateway, tokenizer, scheduler, worker, detokenizer; a scheduler
        and a worker per data-parallel replica) in the foreground, with an embedded
        redis-server unless redis.url is set.
        Overrides are Hydra's: model=smollm2 worker=fake server.port=8001 scheduler.page_size=32
        parallelism=dp2
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "up":
        from jaxstream.stack import up

        if {"-h", "--help"} & set(rest):
            print(USAGE)
            return 0
        try:
            return up(rest)
        except ConfigError as exc:
            print(f"jaxstream: config error: {exc}", file=sys.stderr)
            return 2
    print(f"jaxstream: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
