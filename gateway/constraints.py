"""The peers' constrained-decoding fields, read into the one `protocol.Constraint` a request carries.

1. Each dialect has its reader, which returns what the request asks for as {field: Constraint},
   the field as a client names it (`response_format`, `guided_regex`, `sampling_params.regex`):
   - OpenAI's `response_format` (chat, completions) and the Responses API's `text.format`:
     `text` (no constraint), `json_object` (any object), `json_schema` (its `schema`);
   - vLLM's `structured_outputs` object (`json`, `regex`, `choice`, `grammar`, `json_object`)
     and its older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
   - SGLang's `json_schema` (JSON text), `regex` and `ebnf`: in /generate's `sampling_params`,
     and at the top level of the OpenAI routes.
2. `only_one` keeps the request's one constraint: two are refused naming both (vLLM and SGLang
   refuse that too), and the one left is checked by `jaxstream.grammar.problem`, so a bad
   schema, regex or grammar is a 400 naming its field with llguidance's reason, before the
   request reaches the tokenizer.

A schema may be given as an object or as its JSON text (vLLM takes both for `json`, SGLang the
text); either way it travels as json.dumps writes it. What the peers take and is not built here
(structural tags, a JSON whitespace pattern, closing schemas to additional properties) is refused
by name, never ignored.
"""

from __future__ import annotations

import functools
import json

from gateway.errors import invalid
from gateway.params import JSON_KINDS, check, get
from jaxstream import grammar
from jaxstream.protocol import Constraint

# The most text one constraint may hold (a schema as JSON, a regex, a grammar, the choices): the
# gateway checks it and every worker compiles it, per request. 64 KiB holds any schema written
# by hand or generated from a model class several times over.
MAX_SPEC_CHARS = 64 * 1024
FORMAT_TYPES = ("text", "json_object", "json_schema")
SGLANG_FIELDS = ("json_schema", "regex", "ebnf")
# llguidance's check of a constraint, kept for the last ones seen: clients send the same schema
# with every request, and a /generate batch shares one sampling_params (a large schema: ~10 ms).
problem = functools.lru_cache(maxsize=128)(grammar.problem)


def openai_constraint(body: dict) -> Constraint | None:
    """/v1/chat/completions' and /v1/completions': OpenAI's response_format, vLLM's fields, SGLang's."""
    return only_one({**response_format(body), **vllm_fields(body), **sglang_fields(body)})


def responses_constraint(body: dict) -> Constraint | None:
    """/v1/responses': OpenAI's text.format (the Responses API's place for response_format), and
    the engines' extensions as on chat."""
    check("response_format" not in body, "response_format", "is chat's field: /v1/responses takes the format as text.format")
    text = get(body, "text", dict, {})
    asked = format_constraint(text["format"], "text.format", flat=True) if text.get("format") is not None else {}
    return only_one({**asked, **vllm_fields(body), **sglang_fields(body)})


OTHER_DIALECTS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def generate_constraint(params: dict, prefix: str) -> Constraint | None:
    """SGLang's /generate: json_schema, regex, ebnf of one `sampling_params` object (`prefix` names
    it). The OpenAI routes' spellings are refused there (SGLang fails on them too), not ignored."""
    for name in OTHER_DIALECTS:
        check(params.get(name) is None, prefix + name, "is not a /generate sampling parameter: use json_schema, regex or ebnf")
    return only_one(sglang_fields(params, prefix=prefix))


def refuse_outside_sampling_params(body: dict) -> None:
    """/generate takes SGLang's fields in sampling_params only: one at the top level would be
    ignored by SGLang, and silently unconstrained output is worse than a 400."""
    for name in (*SGLANG_FIELDS, "structural_tag"):
        check(body.get(name) is None, name, f"belongs in sampling_params on /generate ('sampling_params.{name}')")


def only_one(asked: dict[str, Constraint]) -> Constraint | None:
    """The request's constraint, checked; None when it asks for none. Two or more are refused."""
    if len(asked) > 1:
        first, second, *_ = asked
        raise invalid(f"only one kind of structured output may be asked for in a request, got '{first}' and '{second}'", second)
    for name, constraint in asked.items():
        if (reason := problem(constraint)) is not None:
            what = {"json_schema": "JSON schema", "regex": "regular expression", "lark": "grammar"}[constraint.kind]
            raise invalid(f"'{name}' is not a valid {what}: {shortened(reason)}", name)
        return constraint
    return None


# -- OpenAI -------------------------------------------------------------------------------------


def response_format(body: dict) -> dict[str, Constraint]:
    value = get(body, "response_format", dict, None)
    return {} if value is None else format_constraint(value, "response_format", flat=False)


def format_constraint(value: object, name: str, *, flat: bool) -> dict[str, Constraint]:
    """OpenAI's format object: chat's response_format holds a json_schema's fields under
    `json_schema`, the Responses API's text.format beside `type` (`flat`)."""
    check(isinstance(value, dict), name, f"must be an object, got {JSON_KINDS[type(value)]}")
    kind = value.get("type")
    if kind == "structural_tag":
        raise invalid(f"structural tags ('{name}' of type \"structural_tag\") are not supported by this server", f"{name}.type")
    check(kind in FORMAT_TYPES, f"{name}.type", f"must be one of {', '.join(FORMAT_TYPES)}; got {json.dumps(kind)}")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {name: Constraint("json_schema", grammar.ANY_OBJECT)}
    if flat:
        holder, where = value, name
    elif value.get("json_schema") is None and value.get("schema") is not None:
        # SGLang's: a bare schema beside `type` stands for json_schema {"name": its title, "schema": it}
        holder, where = value, name
    else:
        holder, where = get(value, "json_schema", dict, None, prefix=f"{name}."), f"{name}.json_schema"
        check(holder is not None, where, "is required when the type is \"json_schema\"")
    if flat or holder is not value:  # OpenAI's, vLLM's and SGLang's all require the schema's name
        check(isinstance(holder.get("name"), str) and bool(holder["name"]), f"{where}.name", "must be a non-empty string")
    check(holder.get("schema") is not None, f"{where}.schema", "is required: the JSON schema the output must match")
    return {f"{where}.schema": Constraint("json_schema", schema_text(holder["schema"], f"{where}.schema"))}


# -- vLLM ---------------------------------------------------------------------------------------

OPTIONS_REFUSED = {  # vLLM's options for JSON that would change what this server's JSON output is
    "whitespace_pattern": "a whitespace pattern for JSON: JSON is written here with one space after ',' and ':' and "
                          "no other whitespace",
    "disable_additional_properties": "closing JSON schemas to additional properties: give \"additionalProperties\": false "
                                     "in the schema",
}


def vllm_fields(body: dict) -> dict[str, Constraint]:
    """vLLM's structured_outputs object, and its older guided_* fields (guided_decoding_backend, a
    backend's name, is accepted and has nothing to choose here)."""
    asked = {}
    structured = get(body, "structured_outputs", dict, None)
    if structured is not None:
        asked = vllm_object(structured, "structured_outputs.")
        check(bool(asked), "structured_outputs", "must name one kind of constraint: json, regex, choice, grammar or json_object")
    get(body, "guided_decoding_backend", str, None)
    old = {key.removeprefix("guided_"): body[key] for key in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                                             "guided_whitespace_pattern") if key in body}
    return {**asked, **vllm_object(old, "guided_")}


def vllm_object(fields: dict, prefix: str) -> dict[str, Constraint]:
    """{json, regex, choice, grammar, json_object} and the options, under the names `prefix` gives."""
    for option, what in OPTIONS_REFUSED.items():
        if fields.get(option) not in (None, False, ""):
            raise invalid(f"'{prefix}{option}' is not supported by this server ({what})", prefix + option)
    get(fields, "disable_any_whitespace", bool, None, prefix=prefix)  # what this server does anyway
    asked = read_fields(fields, prefix, {"json": json_schema, "regex": regex, "choice": choice, "grammar": ebnf})
    if get(fields, "json_object", bool, False, prefix=prefix):
        asked[prefix + "json_object"] = Constraint("json_schema", grammar.ANY_OBJECT)
    return asked


def choice(value: object, name: str) -> Constraint:
    ok = isinstance(value, list) and bool(value) and all(isinstance(c, str) for c in value)
    check(ok, name, "must be a non-empty list of strings")
    constraint = grammar.from_choice(value)
    bounded(constraint.spec, name)
    return constraint


# -- SGLang -------------------------------------------------------------------------------------


def sglang_fields(fields: dict, *, prefix: str = "") -> dict[str, Constraint]:
    """SGLang's json_schema (the schema's JSON text; an object is taken too), regex and ebnf."""
    return read_fields(fields, prefix, {"json_schema": json_schema, "regex": regex, "ebnf": ebnf})


# -- shared -------------------------------------------------------------------------------------


def shortened(reason: str, most: int = 2000) -> str:
    """llguidance's reason, cut: it may quote the whole regex or grammar line it failed on."""
    return reason if len(reason) <= most else reason[:most] + " ..."


def bounded(text: str, name: str) -> str:
    check(len(text) <= MAX_SPEC_CHARS, name, f"is {len(text)} characters long; at most {MAX_SPEC_CHARS} are taken")
    return text


def schema_text(value: object, name: str) -> str:
    """A JSON schema given as an object or as its JSON text, as JSON text (json.dumps': one form
    whichever way it came, so equal schemas are equal constraints)."""
    if isinstance(value, str):
        bounded(value, name)
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise invalid(f"'{name}' is not valid JSON: {exc.msg} at position {exc.pos}", name) from None
        except RecursionError:
            raise invalid(f"'{name}' is nested too deeply", name) from None
    check(isinstance(value, dict), name, f"must be a JSON schema: an object, or its JSON text; got {JSON_KINDS[type(value)]}")
    try:
        text = json.dumps(value)
    except RecursionError:
        raise invalid(f"'{name}' is nested too deeply", name) from None
    return bounded(text, name)


def read_fields(fields: dict, prefix: str, readers: dict) -> dict[str, Constraint]:
    """{prefix + field: its Constraint} for each field of `readers` the object gives (`readers`:
    field -> reader(value, its name)); a structural tag is refused by name."""
    if fields.get("structural_tag") is not None:
        raise invalid(f"structural tags ('{prefix}structural_tag') are not supported by this server", prefix + "structural_tag")
    return {prefix + field: read(fields[field], prefix + field) for field, read in readers.items() if fields.get(field) is not None}


def json_schema(value: object, name: str) -> Constraint:
    return Constraint("json_schema", schema_text(value, name))


def regex(value: object, name: str) -> Constraint:
    return Constraint("regex", bounded(text_of(value, name), name))


def text_of(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise invalid(f"'{name}' must be a string, got {JSON_KINDS[type(value)]}", name, "invalid_type")
    return value


def ebnf(text: object, name: str) -> Constraint:
    """A GBNF/EBNF grammar (`root ::= ...`) or a Lark one, as SGLang's ebnf and vLLM's grammar take."""
    bounded(text_of(text, name), name)
    try:
        return grammar.from_ebnf(text)
    except ValueError as exc:
        raise invalid(f"'{name}' is not a valid grammar: {shortened(str(exc))}", name) from None
