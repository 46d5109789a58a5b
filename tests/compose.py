"""The Compose files as the tests read them: YAML (anchors and merge keys resolved) and Compose's
variable interpolation of the forms they use: `${NAME}`, `${NAME:-default}`, and `$$` for a literal $."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILES = ("docker-compose.yml", "docker-compose.gpu.yml", "docker-compose.dp2.yml")
MODULES = {"gateway": "gateway", "tokenizer": "tokenizer_svc", "scheduler": "scheduler_svc", "worker": "worker_svc",
           "detokenizer": "detokenizer_svc"}  # the compose service of each role, and the module it runs

_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?::-([^}]*))?\}|\$")


def load(name: str = "docker-compose.yml") -> dict[str, Any]:
    return yaml.safe_load((ROOT / name).read_text())


def interpolate(value: str, environ: Mapping[str, str]) -> str:
    """What Compose makes of `value` given `environ` (a variable set but empty takes the default,
    as `:-` says). Any other form of `$` fails: the files should not use one these tests misread."""
    def substitute(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        if match.group(1) is None:
            raise ValueError(f"an interpolation these tests do not read: {value!r}")
        return environ.get(match.group(1)) or (match.group(2) or "")
    return _VARIABLE.sub(substitute, value)


def service(name: str, environ: Mapping[str, str], compose: dict[str, Any] | None = None) -> tuple[list[str], dict[str, str]]:
    """A service's command and environment as declared, interpolated with `environ`."""
    spec = (compose or load())["services"][name]
    return ([interpolate(arg, environ) for arg in spec["command"]],
            {key: interpolate(str(value), environ) for key, value in spec.get("environment", {}).items()})
