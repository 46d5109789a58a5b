"""Constrained decoding's request fields through the whole fake stack: a bad schema, regex or
grammar is a 400 naming its field on every route, through the official client as through raw
HTTP, and a good one is taken (the fake worker ignores it: only acceptance is checked here;
tests/pipeline/test_structured_jax.py checks the output follows it)."""

import httpx
import openai
import pytest

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
MODEL = "SmolLM2-135M-Instruct"
HI = [{"role": "user", "content": "Hi"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"], "additionalProperties": False}


@pytest.fixture(scope="module")
def stack(fake_stack):
    return fake_stack


def refusal(call) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    assert caught.value.status_code == 400
    return caught.value.body


def test_bad_constraints_on_chat_and_completions_are_400s_naming_the_field(client):
    bad_schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": {"type": "objectx"}}}
    body = refusal(lambda: client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, response_format=bad_schema))
    assert body["param"] == "response_format.json_schema.schema" and "Invalid type: objectx" in body["message"]
    assert body["type"] == "invalid_request_error"
    body = refusal(lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"guided_regex": "[a-"}))
    assert body["param"] == "guided_regex" and "unclosed character class" in body["message"]
    body = refusal(lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                                     extra_body={"structured_outputs": {"grammar": "root ::= (\"a\""}}))
    assert body["param"] == "structured_outputs.grammar" and "Expected ')'" in body["message"]
    body = refusal(lambda: client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, stream=True,
                                                          response_format={"type": "json_object"}, extra_body={"regex": "a+"}))
    assert body["param"] == "regex" and "'response_format' and 'regex'" in body["message"]


def test_bad_constraints_on_generate_and_responses_are_400s_naming_the_field(stack, client):
    def generate(**body) -> httpx.Response:
        return httpx.post(stack + "/generate", json=body, timeout=30)

    r = generate(text="Hi", sampling_params={"max_new_tokens": 2, "ebnf": "root ::= [a-"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.ebnf", r.text
    r = generate(text=["Hi", "Yo"], sampling_params=[{"max_new_tokens": 2}, {"max_new_tokens": 2, "json_schema": "{\"type\": 1}"}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params[1].json_schema", r.text
    r = generate(text="Hi", regex="a+", sampling_params={"max_new_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "regex" and "sampling_params.regex" in r.text
    body = refusal(lambda: client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, text={
        "format": {"type": "json_schema", "name": "person", "schema": {"type": "object", "required": 3}}}))
    assert body["param"] == "text.format.schema"


def test_good_constraints_are_taken_on_every_route(stack, client):
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, response_format=schema).usage.completion_tokens == 2
    streamed = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, stream=True,
                                                   response_format={"type": "json_object"}))
    assert streamed[-1].choices[0].finish_reason == "length"
    for extra in ({"guided_choice": ["yes", "no"]}, {"guided_json": PERSON}, {"structured_outputs": {"regex": r"\d+"}},
                  {"ebnf": 'root ::= "a"+'}):
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=2, extra_body=extra).usage.completion_tokens == 4
    r = httpx.post(stack + "/generate", json={"text": ["Hi", "Yo"], "sampling_params": {"max_new_tokens": 2, "regex": "(yes|no)"}},
                   timeout=30)
    assert r.status_code == 200 and len(r.json()) == 2, r.text
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, text={"format": fmt})
    assert response.status == "incomplete" and response.text.format.type == "json_schema" and response.text.format.name == "person"
