"""gateway/constraints.py: every peer's constrained-decoding fields read into one Constraint, and
every way they can be wrong a 400 naming the field (llguidance's reason for a bad schema, regex or
grammar), never an exception of another kind."""

import json

import pytest

from gateway import constraints
from gateway.body import parse_json
from gateway.constraints import generate_constraint, openai_constraint, refuse_outside_sampling_params, responses_constraint
from gateway.errors import ApiError
from gateway.params import sampling_params
from jaxstream import grammar
from jaxstream.protocol import Constraint

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name"]}
PERSON_TEXT = json.dumps(PERSON)
GBNF = 'root ::= "yes" | "no"'


def refused(read, body: dict, *args) -> ApiError:
    with pytest.raises(ApiError) as caught:
        read(body, *args)
    assert caught.value.status == 400
    return caught.value


def rf_schema(schema, **extra) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, **extra}}}


# -- what each dialect asks for ---------------------------------------------------------------


@pytest.mark.parametrize("body,expected", [
    ({}, None),
    ({"response_format": None}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, Constraint("json_schema", grammar.ANY_OBJECT)),
    (rf_schema(PERSON, strict=True, description="a person"), Constraint("json_schema", PERSON_TEXT)),
    ({"response_format": {"type": "json_schema", "schema": PERSON}}, Constraint("json_schema", PERSON_TEXT)),  # SGLang's bare schema
    ({"structured_outputs": {"json": PERSON}}, Constraint("json_schema", PERSON_TEXT)),
    ({"structured_outputs": {"json": PERSON_TEXT, "disable_any_whitespace": True}}, Constraint("json_schema", PERSON_TEXT)),
    ({"structured_outputs": {"regex": r"\d+"}}, Constraint("regex", r"\d+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, grammar.from_choice(["yes", "no"])),
    ({"structured_outputs": {"grammar": GBNF}}, grammar.from_ebnf(GBNF)),
    ({"structured_outputs": {"json_object": True}}, Constraint("json_schema", grammar.ANY_OBJECT)),
    ({"guided_json": PERSON}, Constraint("json_schema", PERSON_TEXT)),
    ({"guided_json": PERSON_TEXT, "guided_decoding_backend": "xgrammar"}, Constraint("json_schema", PERSON_TEXT)),
    ({"guided_regex": r"\d{3}-\d{4}"}, Constraint("regex", r"\d{3}-\d{4}")),
    ({"guided_choice": ["a", 'say "b"']}, Constraint("lark", 'start: "a" | "say \\"b\\""')),
    ({"guided_grammar": "start: /[0-9]+/"}, Constraint("lark", "start: /[0-9]+/")),
    ({"guided_json": None, "guided_regex": None, "guided_whitespace_pattern": None}, None),
    ({"json_schema": PERSON_TEXT}, Constraint("json_schema", PERSON_TEXT)),  # SGLang's, top level
    ({"regex": "a+"}, Constraint("regex", "a+")),
    ({"ebnf": GBNF}, grammar.from_ebnf(GBNF)),
])
def test_chat_and_completions_read_every_dialect(body, expected):
    assert openai_constraint(body) == expected


def test_responses_read_text_format_flat_and_the_engines_extensions():
    flat = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    assert responses_constraint({"text": {"format": flat}}) == Constraint("json_schema", PERSON_TEXT)
    assert responses_constraint({"text": {"format": {"type": "json_object"}}}) == Constraint("json_schema", grammar.ANY_OBJECT)
    assert responses_constraint({"text": {"format": {"type": "text"}}}) is None
    assert responses_constraint({"text": {}}) is None and responses_constraint({}) is None
    assert responses_constraint({"guided_regex": "a+"}) == Constraint("regex", "a+")
    assert refused(responses_constraint, {"response_format": {"type": "json_object"}}).param == "response_format"
    assert refused(responses_constraint, {"text": {"format": {"type": "json_schema", "schema": PERSON}}}).param == "text.format.name"
    error = refused(responses_constraint, {"text": {"format": {**flat, "schema": {"type": "objectx"}}}})
    assert error.param == "text.format.schema" and "objectx" in error.message


def test_generate_reads_sampling_params_and_refuses_the_fields_at_the_top():
    assert generate_constraint({"json_schema": PERSON_TEXT}, "sampling_params.") == Constraint("json_schema", PERSON_TEXT)
    assert generate_constraint({"regex": "(yes|no)"}, "sampling_params.") == Constraint("regex", "(yes|no)")
    assert generate_constraint({"ebnf": GBNF}, "sampling_params[1].") == grammar.from_ebnf(GBNF)
    assert generate_constraint({"max_new_tokens": 3}, "sampling_params.") is None
    error = refused(generate_constraint, {"regex": "[a-"}, "sampling_params[1].")
    assert error.param == "sampling_params[1].regex" and "unclosed character class" in error.message
    for name in ("regex", "json_schema", "ebnf", "structural_tag"):
        assert refused(refuse_outside_sampling_params, {name: "a"}).param == name
    for name in ("guided_regex", "structured_outputs", "response_format"):  # the OpenAI routes' spellings
        assert refused(generate_constraint, {name: {"regex": "a"}}, "sampling_params.").param == f"sampling_params.{name}"
    refuse_outside_sampling_params({"text": "hi", "sampling_params": {"regex": "a"}})


def test_the_constraint_rides_in_sampling_params():
    sampling = sampling_params({"temperature": 0}, 8, constraint=openai_constraint({"guided_regex": "a+"}))
    assert sampling.constraint == Constraint("regex", "a+") and sampling.reads_output()
    assert sampling_params({}, 8).constraint is None


# -- two at once --------------------------------------------------------------------------------


@pytest.mark.parametrize("body,first,second", [
    ({**rf_schema(PERSON), "guided_regex": "a+"}, "response_format.json_schema.schema", "guided_regex"),
    ({"response_format": {"type": "json_object"}, "regex": "a+"}, "response_format", "regex"),
    ({"structured_outputs": {"json": PERSON, "regex": "a+"}}, "structured_outputs.json", "structured_outputs.regex"),
    ({"guided_choice": ["a"], "guided_grammar": GBNF}, "guided_choice", "guided_grammar"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "structured_outputs.regex", "guided_regex"),
    ({"json_schema": PERSON_TEXT, "ebnf": GBNF}, "json_schema", "ebnf"),
])
def test_more_than_one_constraint_is_refused_naming_two(body, first, second):
    error = refused(openai_constraint, body)
    assert error.param == second and f"'{first}' and '{second}'" in error.message and "only one kind" in error.message


def test_two_in_one_sampling_params_are_refused():
    error = refused(generate_constraint, {"regex": "a", "ebnf": GBNF}, "sampling_params.")
    assert error.param == "sampling_params.ebnf" and "'sampling_params.regex'" in error.message


# -- malformed and invalid ----------------------------------------------------------------------


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be one of text, json_object, json_schema"),
    ({"response_format": {}}, "response_format.type", "must be one of"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "is required"),
    ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format.json_schema", "must be an object"),
    (rf_schema(None), "response_format.json_schema.schema", "is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}}, "response_format.json_schema.name",
     "non-empty string"),
    (rf_schema([1, 2]), "response_format.json_schema.schema", "must be a JSON schema: an object, or its JSON text; got an array"),
    (rf_schema(5), "response_format.json_schema.schema", "got an integer"),
    (rf_schema("{not json"), "response_format.json_schema.schema", "is not valid JSON"),
    (rf_schema({"type": "objectx"}), "response_format.json_schema.schema", "is not a valid JSON schema: Invalid type: objectx"),
    (rf_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), "response_format.json_schema.schema",
     "does not exist"),
    (rf_schema({"type": "string", "pattern": "[a-"}), "response_format.json_schema.schema", "unclosed character class"),
    ({"response_format": {"type": "json_schema", "schema": 3}}, "response_format.schema", "must be a JSON schema"),
    ({"response_format": {"type": "structural_tag", "format": {}}}, "response_format.type", "structural tags"),
    ({"structured_outputs": "json"}, "structured_outputs", "must be an object"),
    ({"structured_outputs": {}}, "structured_outputs", "must name one kind"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "must name one kind"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "must be a boolean"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "must be a string"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list of strings"),
    ({"structured_outputs": {"grammar": "root ::= "}}, None, None),  # an empty rule is a grammar: accepted
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "structural tags"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": r"\s*"}}, "structured_outputs.whitespace_pattern",
     "whitespace pattern"),
    ({"structured_outputs": {"json": PERSON, "disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties", "additional properties"),
    ({"guided_json": "[]"}, "guided_json", "got an array"),
    ({"guided_json": True}, "guided_json", "got a boolean"),
    ({"guided_regex": "[a-"}, "guided_regex", "is not a valid regular expression"),
    ({"guided_regex": ["a"]}, "guided_regex", "must be a string"),
    ({"guided_choice": "a"}, "guided_choice", "non-empty list of strings"),
    ({"guided_choice": ["a", 1]}, "guided_choice", "non-empty list of strings"),
    ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
    ({"guided_grammar": "root ::= (\"a\""}, "guided_grammar", "is not a valid grammar"),
    ({"guided_grammar": "foo ::= \"a\""}, "guided_grammar", "No 'root' rule found"),
    ({"guided_grammar": "start: \"a\" | undefined_rule"}, "guided_grammar", "is not a valid grammar"),
    ({"guided_grammar": "root ::= " + "(" * 3000 + '"a"' + ")" * 3000}, "guided_grammar", "nested too deeply"),
    ({"guided_decoding_backend": 3, "guided_regex": "a"}, "guided_decoding_backend", "must be a string"),
    ({"guided_whitespace_pattern": " ", "guided_json": PERSON}, "guided_whitespace_pattern", "whitespace pattern"),
    ({"json_schema": "{\"type\": 1}"}, "json_schema", "is not a valid JSON schema"),
    ({"json_schema": "true"}, "json_schema", "got a boolean"),
    ({"regex": "(a"}, "regex", "is not a valid regular expression"),
    ({"ebnf": "root ::= [a-"}, "ebnf", "is not a valid grammar"),
    ({"ebnf": 5}, "ebnf", "must be a string"),
    ({"structural_tag": "{}"}, "structural_tag", "structural tags"),
])
def test_a_bad_field_is_a_400_naming_it(body, param, words):
    if param is None:
        assert openai_constraint(body) is not None
        return
    error = refused(openai_constraint, body)
    assert error.param == param and words in error.message, (error.param, error.message)


def test_an_over_large_spec_is_refused_before_llguidance_sees_it():
    limit = constraints.MAX_SPEC_CHARS
    assert openai_constraint({"guided_regex": "a" * limit}) == Constraint("regex", "a" * limit)
    for body, param in (({"guided_regex": "a" * (limit + 1)}, "guided_regex"),
                        ({"ebnf": "root ::= \"" + "a" * limit + "\""}, "ebnf"),
                        ({"guided_json": " " * (limit + 1)}, "guided_json"),
                        (rf_schema({"enum": ["x" * limit]}), "response_format.json_schema.schema"),
                        ({"guided_choice": ["x" * 1000] * 70}, "guided_choice")):
        error = refused(openai_constraint, body)
        assert error.param == param and f"at most {limit}" in error.message


def test_a_long_reason_is_cut():
    error = refused(openai_constraint, {"guided_regex": "(" * 50_000})
    assert error.param == "guided_regex" and len(error.message) < 2100 and error.message.endswith(" ...")


def test_a_schema_nested_past_the_recursion_limit_is_a_400():
    deep = '{"items": ' * 5000 + "{}" + "}" * 5000
    error = refused(openai_constraint, {"guided_json": deep})
    assert error.param == "guided_json" and "nested too deeply" in error.message
    with pytest.raises(ApiError, match="nested too deeply"):  # the whole body, before any field is read
        parse_json(b"[" * 100_000)
