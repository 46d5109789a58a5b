"""`/openapi.json` (gateway/openapi.py) against the route table it describes: every route served is
in the document with each of its methods, nothing else is, and the key classes show as security;
every request field of the table (gateway/fields.py) is in the bodies that carry it."""

from types import SimpleNamespace

import jsonschema
import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

from gateway.app import build_app
from gateway.auth import Access
from gateway.fields import (
    ABORT, CHAT, COMPLETIONS, DETOKENIZE, FIELDS, GENERATE, INFERENCE, INFERENCE_SAMPLING, MAX_TOKEN_ID, RESPONSES, SAMPLING_PARAMS, SCORE,
    STREAM_OPTIONS, TOKENIZE,
)
from gateway.openapi import OPERATIONS, document
from jaxstream.config import load_config
from jaxstream.keys import Keys

BOTH, NONE = Keys("user-key", "admin-key"), Keys()


def app(keys: Keys):
    return build_app(None, SimpleNamespace(bus=None), load_config(["worker=fake"]), None, keys)


def served(application) -> dict[str, set[str]]:
    """{OpenAPI path: methods}, from the app's own routes."""
    return {route.path.replace(":path}", "}"): set(route.methods) - {"HEAD"} for route in application.routes}


def test_every_route_and_method_is_described_and_nothing_else():
    application = app(BOTH)
    doc = TestClient(application).get("/openapi.json").json()
    routes = served(application)
    assert {path: {m.upper() for m in ops} for path, ops in doc["paths"].items()} == routes
    assert set(OPERATIONS) == set(routes)  # no entry left behind for a route that is gone
    assert doc["openapi"].startswith("3.") and doc["info"]["version"]


def test_a_route_without_an_entry_fails_at_start_up():
    async def endpoint(request):
        return None
    endpoint.access = Access.USER
    with pytest.raises(KeyError, match="/v1/new_thing has no entry"):
        document([Route("/v1/new_thing", endpoint, methods=["POST"])], NONE)


def test_bodies_are_json_schemas_naming_the_main_fields():
    doc = document(app(NONE).routes, NONE)
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            for media in op.get("requestBody", {}).get("content", {}).values():
                jsonschema.Draft202012Validator.check_schema(media["schema"])
            unavailable = path not in ("/openapi.json", "/version", "/get_world_size", "/v1/responses/{response_id}")  # these read no service
            assert "200" in op["responses"] and ("503" in op["responses"] or not unavailable), (path, method)
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["required"] == ["messages"] and chat["additionalProperties"] is True
    assert {"messages", "max_tokens", "temperature", "stop", "logit_bias", "stream", "tools"} <= set(chat["properties"])
    generate = doc["paths"]["/generate"]
    assert set(generate) == {"post", "put"} and "sampling_params" in generate["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
    # a body the gateway serves validates against its schema
    jsonschema.validate({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "seed": 7, "vendor_field": 1}, chat)
    assert not doc["paths"]["/continue_generation"]["post"]["requestBody"]["required"]  # takes no body at all too
    assert "requestBody" not in doc["paths"]["/flush_cache"]["get"]


def test_security_follows_each_route_class_and_the_keys_configured():
    guarded = document(app(BOTH).routes, BOTH)
    assert set(guarded["components"]["securitySchemes"]) == {"bearer", "apiKeyHeader"}
    for path in ("/v1/chat/completions", "/abort_request", "/v1/models"):
        op = next(iter(guarded["paths"][path].values()))
        assert {"bearer": []} in op["security"] and "401" in op["responses"], path
    for path in ("/health", "/metrics", "/openapi.json"):  # probes stay open
        assert guarded["paths"][path]["get"]["security"] == [] and "401" not in guarded["paths"][path]["get"]["responses"]
    open_ = document(app(NONE).routes, NONE)
    assert all(op["security"] == [] and "401" not in op["responses"] for ops in open_["paths"].values() for op in ops.values())


def test_the_document_is_open_when_keys_guard_everything_else():
    client = TestClient(app(Keys("user-key", "admin-key", health_needs_key=False)))
    assert client.get("/openapi.json").status_code == 200
    assert client.get("/v1/models").status_code == 401


def test_every_field_of_the_table_is_in_each_body_that_carries_it_under_each_spelling():
    doc = document(app(NONE).routes, NONE)

    def schema(path: str) -> dict:
        return doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]

    bodies = {where: schema(where) for where in (CHAT, COMPLETIONS, RESPONSES, GENERATE, SCORE, TOKENIZE, DETOKENIZE, ABORT, INFERENCE)}
    bodies[SAMPLING_PARAMS] = bodies[GENERATE]["properties"]["sampling_params"]["oneOf"][0]
    bodies[INFERENCE_SAMPLING] = bodies[INFERENCE]["properties"]["sampling_params"]
    bodies[STREAM_OPTIONS] = bodies[CHAT]["properties"]["stream_options"]
    for row in FIELDS:
        for where in row.bodies:
            for spelling in row.spellings:
                assert bodies[where]["properties"][spelling]["description"], (row.name, where, spelling)
            assert (row.name in bodies[where].get("required", ())) == (where in row.required_in), (row.name, where)
    # a range the table states is in the document: top_k's -1 (off) joins its range, truncation's stands beside it
    chat = bodies[CHAT]["properties"]
    assert (chat["top_k"]["minimum"], chat["top_k"]["maximum"], chat["top_p"]["exclusiveMinimum"]) == (-1, MAX_TOKEN_ID, 0)
    assert chat["truncate_prompt_tokens"]["anyOf"] == [{"const": -1}, {"minimum": 1}]


def test_sglangs_error_shape_is_for_routes_that_exist():
    from gateway.errors import SGLANG_PATHS
    assert SGLANG_PATHS <= set(served(app(NONE)))  # a path dropped from the app leaves no stale entry
