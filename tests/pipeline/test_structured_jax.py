"""Constrained decoding on the JAX worker with SmolLM2's real weights: every dialect's constraint
(gateway/constraints.py) holds the output to it, greedy and sampled at temperature 1, and the
request stops (EOS) once the output is a whole match.

These need the worker's token mask (the request's Constraint applied before sampling); a worker
that ignores the constraint fails them. The schemas bound every string, number and array, so a
whole match is at most ~80 tokens whatever the model picks (max_tokens 100 leaves room, and the
model, at temperature 1 too, ends them in 30 to 50). Requests go concurrently: the stack batches
them (about 20 sequences in all)."""

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
MODEL = "SmolLM2-135M-Instruct"

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"type": "string", "enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2},
}, "required": ["name", "age", "role", "tags"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {  # nested objects
    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
    "customer": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    }, "required": ["name", "address"], "additionalProperties": False},
    "paid": {"type": "boolean"},
}, "required": ["id", "customer", "paid"], "additionalProperties": False}


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)
    continent: Literal["Africa", "America", "Asia", "Europe", "Oceania"]


class Town(BaseModel):
    """A float its schema leaves unbounded: held to a double's digits (jaxstream/grammar.py), else
    SmolLM2, greedy, wrote "3121222231234444444..." until max_tokens."""

    name: str = Field(max_length=24)
    population_millions: float


@pytest.fixture(scope="module")
def stack(jax_stack):
    return jax_stack


def concurrently(*calls):
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def test_chat_json_schema_output_validates_greedy_and_sampled(client):
    def ask(question: str, schema: dict, **sampling):
        return lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=100,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}, **sampling)

    cases = [("Describe a user of a web site as JSON.", PERSON), ("Give an example order as JSON.", ORDER)]
    answers = concurrently(*(ask(question, schema, **sampling) for question, schema in cases
                             for sampling in ({"temperature": 0}, {"temperature": 1, "seed": 7, "n": 3})))
    for (_, schema), greedy, sampled in zip(cases, answers[::2], answers[1::2]):
        for choice in greedy.choices + sampled.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema)
        assert len({c.message.content for c in sampled.choices}) > 1  # three seeds, not one answer thrice


def test_a_token_limit_cuts_constrained_output(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give an example order as JSON."}], max_tokens=5, temperature=0,
        stream=True, response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}))
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text and (text.startswith('{"id": ') or '{"id": '.startswith(text))  # the schema's first key, compactly


def test_completions_regex_and_choice(client):
    phone = r"\d{3}-\d{4}"
    colors = [" red", " green", " blue"]
    greedy, sampled, chosen = concurrently(
        lambda: client.completions.create(model=MODEL, prompt="Call me at my office number: ", max_tokens=20, temperature=0,
                                          extra_body={"guided_regex": phone}),
        lambda: client.completions.create(model=MODEL, prompt="Call me at my office number: ", max_tokens=20, temperature=1,
                                          seed=3, n=2, extra_body={"structured_outputs": {"regex": phone}}),
        lambda: client.completions.create(model=MODEL, prompt="My favourite colour is", max_tokens=10, temperature=1, seed=5,
                                          n=3, extra_body={"guided_choice": colors}))
    for choice in greedy.choices + sampled.choices:
        assert re.fullmatch(phone, choice.text) and choice.finish_reason == "stop", choice.text
    assert all(c.text in colors and c.finish_reason == "stop" for c in chosen.choices), [c.text for c in chosen.choices]


def test_generate_regex_and_ebnf(stack):
    body = {"text": ["Is the sky blue? Answer: ", "Question: is water wet?\n"],
            "sampling_params": [{"max_new_tokens": 10, "temperature": 0, "regex": "(yes|no)"},
                                {"max_new_tokens": 20, "temperature": 1, "sampling_seed": 2,
                                 "ebnf": 'root ::= "The answer is " ("yes" | "no") "."'}]}
    r = httpx.post(stack + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    regex_answer, ebnf_answer = r.json()
    assert regex_answer["text"] in ("yes", "no") and regex_answer["meta_info"]["finish_reason"]["type"] == "stop"
    assert re.fullmatch(r"The answer is (yes|no)\.", ebnf_answer["text"]), ebnf_answer["text"]
    assert ebnf_answer["meta_info"]["finish_reason"]["type"] == "stop"


def test_the_official_clients_parse_helpers(client):
    question = [{"role": "user", "content": "Tell me about Paris as JSON."}]

    def streamed():
        with client.chat.completions.stream(model=MODEL, messages=question, response_format=City, max_tokens=100,
                                            temperature=1, seed=11) as stream:
            return stream.get_final_completion()

    parsed, final, response, town = concurrently(
        lambda: client.chat.completions.parse(model=MODEL, messages=question, response_format=City, max_tokens=100, temperature=0),
        streamed,
        lambda: client.responses.parse(model=MODEL, input="Tell me about Paris as JSON.", text_format=City, max_output_tokens=100,
                                       temperature=0),
        lambda: client.chat.completions.parse(model=MODEL, messages=question, response_format=Town, max_tokens=100, temperature=0))
    assert isinstance(parsed.choices[0].message.parsed, City) and parsed.choices[0].finish_reason == "stop"
    assert isinstance(final.choices[0].message.parsed, City) and final.choices[0].finish_reason == "stop"
    assert isinstance(response.output_parsed, City) and response.status == "completed"
    assert isinstance(town.choices[0].message.parsed, Town) and town.choices[0].finish_reason == "stop"
