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
"1111111111..." until max_tokens. A `number` the schema leaves unbounded is held likewise to what a
double holds (I-JSON again: at most 17 significant digits), as plain decimals: at most 17 digits in
all, of which at most 10 after the point (llguidance's limit on a `multipleOf`), no exponent (a range
in llguidance admits none). Under the openai client's parse() with a float field SmolLM2 otherwise
wrote "3121222231234444444..." for its whole max_tokens. A bound the schema states is kept as it is.
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
SIGNIFICANT_DIGITS = 17  # a double's: any double is written exactly enough in 17 significant digits
FRACTION_DIGITS = 10  # the most llguidance takes in a multipleOf (1e-11 is refused as "too many digits")
# An unbounded number: one plain-decimal form per count d of digits before the point, |x| < 10^d
# with at most 17 - d digits after it (capped).
BOUNDED_NUMBER = tuple({"type": "number", "exclusiveMinimum": -float(f"1e{d}"), "exclusiveMaximum": float(f"1e{d}"),
                        "multipleOf": float(f"1e-{min(FRACTION_DIGITS, SIGNIFICANT_DIGITS - d)}") if d < SIGNIFICANT_DIGITS else 1}
                       for d in range(SIGNIFICANT_DIGITS + 1))
# What states a number's bound of its own, or chooses its values otherwise: such a schema is kept.
NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "enum", "const", "anyOf", "oneOf", "allOf")


def grammar(constraint: Constraint) -> str:
    """The llguidance grammar (its JSON text) of a constraint. ValueError for an unknown kind or a
    schema that is not a JSON object."""
    match constraint.kind:
        case "json_schema":
            try:
                schema = json.loads(constraint.spec)
            except ValueError as exc:
                raise ValueError(f"the schema is not JSON: {exc}") from None
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(_bounded_numbers(schema)), overrides=JSON_OPTIONS)
        case "regex":
            return llguidance.LLMatcher.grammar_from_regex(constraint.spec)
        case "lark":
            return llguidance.LLMatcher.grammar_from_lark(constraint.spec)
    raise ValueError(f"unknown constraint kind {constraint.kind!r} (one of {', '.join(KINDS)})")


def _bounded_numbers(schema):
    """The schema with SAFE_INTEGER's range on every integer subschema that states no bound of its
    own, and BOUNDED_NUMBER's forms for every such number subschema (a list of types holding
    "number" becomes a choice between its other types and those forms)."""
    if isinstance(schema, list):
        return [_bounded_numbers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded_numbers(v) for k, v in schema.items()}
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "number" in kinds and not any(k in out for k in NUMBER_BOUNDS):
        others = [k for k in kinds if k not in ("number", "integer")]  # an integer is a number too
        del out["type"]
        out["anyOf"] = [{"type": others}, *BOUNDED_NUMBER] if others else list(BOUNDED_NUMBER)
    elif "integer" in kinds and "number" not in kinds:
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
