"""jaxstream/grammar.py: an integer or a number a schema leaves unbounded is held to I-JSON's range
and a double's 17 significant digits (a small model otherwise writes digits until its token limit);
a bound the schema states is kept."""

import json

import llguidance

from jaxstream import grammar
from jaxstream.protocol import Constraint


def test_unbounded_integers_get_the_interoperable_range_and_stated_bounds_stay():
    schema = {"type": "object", "required": ["n"], "additionalProperties": False,
              "properties": {"n": {"type": "integer"}, "m": {"type": ["integer", "null"], "minimum": 3},
                             "x": {"type": "number"}, "items": {"type": "array", "items": {"type": "integer", "exclusiveMaximum": 9}}}}
    bounded = grammar._bounded_numbers(schema)
    assert bounded["properties"]["n"] == {"type": "integer", "minimum": -grammar.SAFE_INTEGER, "maximum": grammar.SAFE_INTEGER}
    assert bounded["properties"]["m"] == {"type": ["integer", "null"], "minimum": 3, "maximum": grammar.SAFE_INTEGER}
    assert bounded["properties"]["x"] == {"anyOf": list(grammar.BOUNDED_NUMBER)}
    assert bounded["properties"]["items"]["items"] == {"type": "integer", "exclusiveMaximum": 9, "minimum": -grammar.SAFE_INTEGER}
    assert schema["properties"]["n"] == {"type": "integer"}  # the client's schema is not changed in place


def test_the_largest_safe_integer_matches_and_one_more_digit_does_not(tokenizer_info):
    tok = llguidance.LLTokenizer(tokenizer_info.tokenizer.backend_tokenizer.to_str(), n_vocab=tokenizer_info.vocab_size)
    text = grammar.grammar(Constraint("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                                                 "required": ["n"], "additionalProperties": False})))
    for number, ok in ((grammar.SAFE_INTEGER, True), (-grammar.SAFE_INTEGER, True), (10 * grammar.SAFE_INTEGER, False)):
        ids = tokenizer_info.tokenizer.encode(f'{{"n": {number}}}')
        assert (llguidance.LLMatcher(tok, text).validate_tokens(ids) == len(ids)) is ok, number


def test_an_unbounded_number_ends_within_a_doubles_digits_and_ordinary_floats_match(tokenizer_info):
    tok = llguidance.LLTokenizer(tokenizer_info.tokenizer.backend_tokenizer.to_str(), n_vocab=tokenizer_info.vocab_size)
    schema = {"type": "object", "required": ["x", "y", "z"], "additionalProperties": False,
              "properties": {"x": {"type": "number"}, "y": {"type": ["number", "null"]}, "z": {"type": "number", "maximum": 1000}}}
    text = grammar.grammar(Constraint("json_schema", json.dumps(schema)))
    for x, y, ok in (("3.14", "null", True), ("-0.5", "12", True), ("12345678901234567", "0.0000000001", True), ("1234.5678", "-7", True),
                     ("3121222231234444444", "null", False), ("123456789012345678", "null", False),  # 18 digits
                     ("1.5", "0.00000000001", False)):  # 11 after the point
        ids = tokenizer_info.tokenizer.encode(f'{{"x": {x}, "y": {y}, "z": 999.1234567890123456}}')  # z states its bound: kept, digits and all
        assert (llguidance.LLMatcher(tok, text).validate_tokens(ids) == len(ids)) is ok, (x, y)


def test_a_schema_that_is_not_json_is_named_so():
    assert grammar.problem(Constraint("json_schema", "{nope")).startswith("the schema is not JSON")
