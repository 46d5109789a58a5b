"""What `--help` prints (`reference()`), read from the schemas and `configs/` alone, so it cannot go stale.

Each field's meaning is the docstring under it in its schema's class body: its first line is what
`--help` prints beside the key, the rest says why.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
from collections.abc import Iterator
from typing import Any

from jaxstream.config.app import GROUPS, default_options, group_options


@functools.cache
def field_docs(schema: type) -> dict[str, str]:
    """Field name -> the docstring written under the field in the schema's class body."""
    body = ast.parse(inspect.getsource(schema)).body[0].body
    return {
        node.target.id: inspect.cleandoc(doc.value.value)
        for node, doc in zip(body, body[1:])
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)
    }


def schema_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def reference() -> str:
    """What `--help` prints: each group's options and every key's type, default and meaning, all
    read from the schemas and `configs/`, so nothing here can go stale."""
    chosen = default_options()
    width = max(map(len, GROUPS)) + 1
    lines = ["config groups (choose with group=option; * marks the default):"]
    for group in GROUPS:
        options = [option + "*" * (option == chosen.get(group)) for option in group_options(group)]
        lines.append(f"  {group + ':':<{width}} {', '.join(options)}")
    lines += ["", "keys (set with group.key=value; the defaults are the schemas', which a group's file may change:",
              "`jaxstream config [overrides...]` prints the composed values):"]
    for group, schema in GROUPS.items():
        lines += ["", f"{group}: {inspect.getdoc(schema)}"]
        for key, f, meaning in schema_keys(group, schema):
            lines.append(f"  {key}: {f.type} = {json.dumps(schema_default(f), default=str)}  — {meaning}")
    return "\n".join(lines)


def schema_keys(prefix: str, schema: type) -> Iterator[tuple[str, dataclasses.Field, str]]:
    """(key, field, its meaning's first line) of every key of `schema` under `prefix`; a field that is
    a schema of its own (worker.lora) gives its keys instead, under its name."""
    docs = field_docs(schema)
    for f in dataclasses.fields(schema):
        default = schema_default(f)
        if dataclasses.is_dataclass(default):
            yield from schema_keys(f"{prefix}.{f.name}", type(default))
        else:
            yield f"{prefix}.{f.name}", f, docs.get(f.name, "").partition("\n")[0]
