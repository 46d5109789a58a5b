"""jaxstream/grammar.py: an integer a schema leaves unbounded is held to I-JSON's range (a small
model otherwise writes digits until its token limit); a bound the schema states is kept."""

import json

import llguidance

from jaxstream import grammar
from jaxstream.protocol import Constraint


def test_unbounded_integers_get_the_interoperable_range_and_stated_bounds_stay():
    schema = {"type": "object", "required": ["n"], "additionalProperties": False,
              "properties": {"n": {"type": "integer"}, "m": {"type": ["integer", "null"], "minimum": 3},
                             "x": {"type": "number"}, "items": {"type": "array", "items": {"type": "integer", "exclusiveMaximum": 9}}}}
    bounded = grammar._bounded_integers(schema)
    assert bounded["properties"]["n"] == {"type": "integer", "minimum": -grammar.SAFE_INTEGER, "maximum": grammar.SAFE_INTEGER}
    assert bounded["properties"]["m"] == {"type": ["integer", "null"], "minimum": 3, "maximum": grammar.SAFE_INTEGER}
    assert bounded["properties"]["x"] == {"type": "number"}
    assert bounded["properties"]["items"]["items"] == {"type": "integer", "exclusiveMaximum": 9, "minimum": -grammar.SAFE_INTEGER}
    assert schema["properties"]["n"] == {"type": "integer"}  # the client's schema is not changed in place


def test_the_largest_safe_integer_matches_and_one_more_digit_does_not(tokenizer_info):
    tok = llguidance.LLTokenizer(tokenizer_info.tokenizer.backend_tokenizer.to_str(), n_vocab=tokenizer_info.vocab_size)
    text = grammar.grammar(Constraint("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                                                 "required": ["n"], "additionalProperties": False})))
    for number, ok in ((grammar.SAFE_INTEGER, True), (-grammar.SAFE_INTEGER, True), (10 * grammar.SAFE_INTEGER, False)):
        ids = tokenizer_info.tokenizer.encode(f'{{"n": {number}}}')
        assert (llguidance.LLMatcher(tok, text).validate_tokens(ids) == len(ids)) is ok, number


def test_a_schema_that_is_not_json_is_named_so():
    assert grammar.problem(Constraint("json_schema", "{nope")).startswith("the schema is not JSON")
