"""The key check of every route class (gateway/auth.py), without Redis: the decision per class and
configuration of keys, the headers a key comes in, every route's class as the route table gives
it, and the 401 as a client sees it (OpenAI's error shape, WWW-Authenticate, the handler not run)."""

from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from gateway.app import build_app
from gateway.auth import Access, describe, presented, refusal
from jaxstream.config import load_config
from jaxstream.keys import Keys

USER, ADMIN = "user-key", "admin-key"
BOTH, USER_ONLY, ADMIN_ONLY, NONE = Keys(USER, ADMIN), Keys(USER, None), Keys(None, ADMIN), Keys()


@pytest.mark.parametrize("keys,access,offered,allowed", [
    # no key configured: today's behaviour, every class open
    (NONE, Access.USER, [], True), (NONE, Access.ADMIN, [], True), (NONE, Access.PROBE, [], True),
    (NONE, Access.ADMIN, ["anything"], True),
    # both keys: user routes take either, admin routes only the admin key
    (BOTH, Access.USER, [], False), (BOTH, Access.USER, ["wrong"], False),
    (BOTH, Access.USER, [USER], True), (BOTH, Access.USER, [ADMIN], True),
    (BOTH, Access.ADMIN, [], False), (BOTH, Access.ADMIN, [USER], False), (BOTH, Access.ADMIN, [ADMIN], True),
    (BOTH, Access.PROBE, [], True),
    # only a user key: the admin routes take it (SGLang's api_key on its admin-optional routes)
    (USER_ONLY, Access.USER, [USER], True), (USER_ONLY, Access.USER, [], False),
    (USER_ONLY, Access.ADMIN, [USER], True), (USER_ONLY, Access.ADMIN, [], False), (USER_ONLY, Access.ADMIN, ["wrong"], False),
    # only an admin key: generation stays open, the admin routes want it
    (ADMIN_ONLY, Access.USER, [], True), (ADMIN_ONLY, Access.ADMIN, [], False), (ADMIN_ONLY, Access.ADMIN, [ADMIN], True),
    # a second header with the right key opens it whatever the first says
    (BOTH, Access.ADMIN, ["wrong", ADMIN], True),
    # probes want the user key only when configured to (and only when there is one)
    (Keys(USER, ADMIN, health_needs_key=True), Access.PROBE, [], False),
    (Keys(USER, ADMIN, health_needs_key=True), Access.PROBE, [USER], True),
    (Keys(USER, ADMIN, health_needs_key=True), Access.PROBE, [ADMIN], True),
    (Keys(None, ADMIN, health_needs_key=True), Access.PROBE, [], True),
])
def test_who_may_call_each_class(keys, access, offered, allowed):
    refused = refusal(access, keys, offered)
    assert (refused is None) == allowed
    if refused is not None:
        assert refused.status == 401 and refused.code == "invalid_api_key"
        assert USER not in refused.message and ADMIN not in refused.message


def request(headers: dict[str, str]) -> SimpleNamespace:
    from starlette.datastructures import Headers
    return SimpleNamespace(headers=Headers(headers=headers))


@pytest.mark.parametrize("headers,keys", [
    ({"Authorization": "Bearer k1"}, ["k1"]),
    ({"authorization": "bearer  k1 "}, ["k1"]),  # the scheme is case-blind (RFC 6750)
    ({"Authorization": "Basic k1"}, []),
    ({"Authorization": "Bearer"}, []),
    ({"x-api-key": "k2"}, ["k2"]),  # Anthropic's header, which SGLang takes too
    ({"Authorization": "Bearer k1", "X-Api-Key": "k2"}, ["k1", "k2"]),
    ({}, []),
])
def test_a_key_comes_as_a_bearer_token_or_an_x_api_key(headers, keys):
    assert presented(request(headers)) == keys


# What changes state or reveals configuration; the monitoring routes; every other route is a user one.
ADMIN_ROUTES = {"/abort_request", "/flush_cache", "/get_server_info", "/server_info", "/pause_generation",
                "/continue_generation", "/update_weights_from_disk", "/update_weights_from_tensor",
                "/update_weight_version", "/list_weights", "/release_memory_occupation", "/resume_memory_occupation",
                "/pause", "/resume", "/sleep", "/wake_up", "/reset_prefix_cache", "/get_world_size"}  # and vLLM's
ADMIN_ROUTES |= {"/init_weights_update_group", "/update_weights_from_distributed", "/prepare_weights_update",  # collective sync
                 "/complete_weights_update", "/receive_weights", "/destroy_weights_update_group", "/init_weight_transfer_engine",
                 "/start_weight_update", "/update_weights", "/finish_weight_update"}
ADMIN_ROUTES |= {"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/load_lora_adapter", "/unload_lora_adapter",  # LoRA adapters
                 "/load_lora_adapter_from_tensors"}
PROBE_ROUTES = {"/health", "/health_generate", "/metrics", "/stats", "/openapi.json"}


async def flushed():
    return []


def app(keys: Keys):
    """The gateway's app on stubs: only /flush_cache reaches its pipeline (an idle one)."""
    pipeline = SimpleNamespace(bus=None, flush_cache=flushed)
    return build_app(None, pipeline, load_config(["worker=fake"]), None, keys)


def test_every_route_has_its_class():
    classes = {route.path: route.endpoint.access for route in app(BOTH).routes}
    assert {p for p, a in classes.items() if a is Access.ADMIN} == ADMIN_ROUTES
    assert {p for p, a in classes.items() if a is Access.PROBE} == PROBE_ROUTES
    users = {p for p, a in classes.items() if a is Access.USER}
    assert users | ADMIN_ROUTES | PROBE_ROUTES == set(classes)
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/generate", "/v1/score",
            "/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize", "/get_model_info"} <= users
    # vLLM's --api-key covers /v1; its LoRA load and unload change what is served: admin here, as every control route
    assert all(classes[p] is Access.USER for p in classes if p.startswith("/v1/") and "lora_adapter" not in p)


def test_a_refusal_is_openai_shaped_and_runs_nothing():
    client = TestClient(app(BOTH))
    for headers in ({}, {"Authorization": f"Bearer {USER}"}, {"Authorization": "Bearer wrong"}):
        response = client.post("/flush_cache", headers=headers)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key" and error["param"] is None
        assert "admin API key" in error["message"] and USER not in response.text and ADMIN not in response.text
    # a user route refuses before reading the body: this one is not even JSON
    response = client.post("/v1/chat/completions", content=b"not json", headers={"Authorization": "Bearer wrong"})
    assert response.status_code == 401 and response.json()["error"]["message"].startswith("Incorrect API key provided")
    assert client.post("/flush_cache", headers={"Authorization": f"Bearer {ADMIN}"}).text == "Cache flushed.\n"
    assert client.post("/flush_cache", headers={"x-api-key": ADMIN}).status_code == 200


def test_without_keys_every_route_stays_open():
    assert TestClient(app(NONE)).post("/flush_cache").text == "Cache flushed.\n"


def test_the_start_up_line_says_what_guards_what_and_never_a_key():
    assert "every route is open" in describe(NONE)
    line = describe(USER_ONLY)
    assert "admin routes the user key (no admin key set)" in line and USER not in line
    assert "generation routes take no key" in describe(ADMIN_ONLY)
