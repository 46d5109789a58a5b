"""Constraints (protocol.Constraint) as llguidance grammars: one place for how each kind compiles.

The gateway builds a Constraint from the client's fields and checks it here (`problem`), before the
request reaches a tokenizer or scheduler, so a bad schema, regex or grammar is a 400 naming the
library's reason. The worker compiles the same text (`grammar`) into a matcher per request, with
its tokenizer (worker_svc/constrained.py). Neither needs the other's view: the check is of the
grammar alone, which is what can be wrong in a request.

JSON is written compactly with one space after ',' and ':' (Python's json.dumps separators), and no
other whitespace: a model that could put any whitespace between tokens can also loop on newlines
until its token limit, which small models do. For the same reason an integer whose schema gives no
bound is held to I-JSON's interoperable range (RFC 7493: |n| <= 2^53 - 1, what a JSON parser that
reads numbers as doubles keeps exactly): SmolLM2, greedy, otherwise writes a population as
"1111111111..." until max_tokens. A bound the schema states is kept as it is.
"""

from __future__ import annotations

import json

import llguidance

from jaxstream.protocol import Constraint

KINDS = ("json_schema", "regex", "lark")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A JSON object of any shape: OpenAI's response_format {"type": "json_object"}.
ANY_OBJECT = '{"type": "object"}'
SAFE_INTEGER = 2**53 - 1  # I-JSON's (RFC 7493) largest interoperable integer


def grammar(constraint: Constraint) -> str:
    """The llguidance grammar (its JSON text) of a constraint. ValueError for an unknown kind or a
    schema that is not a JSON object."""
    match constraint.kind:
        case "json_schema":
            try:
                schema = json.loads(constraint.spec)
            except ValueError as exc:
                raise ValueError(f"the schema is not JSON: {exc}") from None
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(_bounded_integers(schema)), overrides=JSON_OPTIONS)
        case "regex":
            return llguidance.LLMatcher.grammar_from_regex(constraint.spec)
        case "lark":
            return llguidance.LLMatcher.grammar_from_lark(constraint.spec)
    raise ValueError(f"unknown constraint kind {constraint.kind!r} (one of {', '.join(KINDS)})")


def _bounded_integers(schema):
    """The schema with SAFE_INTEGER's range on every integer subschema that states no bound of its own."""
    if isinstance(schema, list):
        return [_bounded_integers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded_integers(v) for k, v in schema.items()}
    kind = schema.get("type")
    if kind == "integer" or (isinstance(kind, list) and "integer" in kind and "number" not in kind):
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
    return out


def problem(constraint: Constraint) -> str | None:
    """Why the constraint cannot be used (the library's words), or None when it can."""
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar(constraint))
    except ValueError as exc:
        return str(exc)
    return error.strip() or None


def from_ebnf(text: str) -> Constraint:
    """A GBNF/EBNF grammar (SGLang's `ebnf`, vLLM's `grammar`; `root ::= ...`) or a Lark one, as Lark.
    ValueError naming the converter's reason when it is neither."""
    try:
        return Constraint("lark", llguidance.gbnf_to_lark.any_to_lark(text))
    except RecursionError:  # the converter recurses per nesting level
        raise ValueError("the grammar is nested too deeply") from None
    except Exception as exc:  # GbnfToLarkError, and a bare Exception for some mistakes ("No 'root' rule found")
        raise ValueError(str(exc)) from None


def from_choice(choices: list[str]) -> Constraint:
    """Exactly one of the strings (vLLM's guided_choice)."""
    return Constraint("lark", "start: " + " | ".join(json.dumps(c) for c in choices))
