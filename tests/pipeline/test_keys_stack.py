"""API keys on a whole stack (`jaxstream up worker=fake`): the user key from the environment, the
admin key from a file, Redis behind a password (an ACL user of the session's Redis). Who gets in
where, the official client's view of it, and no secret in a response, a log or a child's arguments."""

import os
import secrets
from pathlib import Path

import httpx
import openai
import pytest
import redis

from jaxstream.keys import API_KEY_ENV
from tests.support import children_of, serve_process

pytestmark = pytest.mark.usefixtures("idle_after_each_test")

USER_KEY = f"user-{secrets.token_urlsafe(16)}"
ADMIN_KEY = f"admin-{secrets.token_urlsafe(16)}"
REDIS_PASSWORD = f"redis-{secrets.token_urlsafe(16)}"
SECRETS = (USER_KEY, ADMIN_KEY, REDIS_PASSWORD)

CHAT = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def redis_user(redis_url):
    """A password-protected user on the session's Redis (its default user stays as it is, for the
    other stacks): the URL to reach it with."""
    name = f"keys-test-{secrets.token_hex(4)}"
    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", name, "on", f">{REDIS_PASSWORD}", "~*", "&*", "+@all")
    host = redis_url.split("://", 1)[1]
    yield f"redis://{name}:{REDIS_PASSWORD}@{host}"
    admin.execute_command("ACL", "DELUSER", name)
    admin.close()


@pytest.fixture(scope="module")
def keyed(redis_user, tmp_path_factory):
    admin_file = tmp_path_factory.mktemp("keys") / "admin"
    admin_file.write_text(ADMIN_KEY + "\n")
    env = {**os.environ, API_KEY_ENV: USER_KEY}  # `jaxstream up` passes its environment on to the gateway
    yield from serve_process(redis_user, "worker=fake", f"server.admin_api_key_file={admin_file}", env=env)


@pytest.fixture(scope="module")
def stack(keyed):
    return keyed[1]


def test_no_key_gets_a_401_on_generation_and_admin_routes(stack):
    for method, path in (("POST", "/v1/chat/completions"), ("POST", "/generate"), ("GET", "/v1/models"),
                         ("POST", "/flush_cache"), ("POST", "/abort_request"), ("GET", "/get_server_info")):
        response = httpx.request(method, stack + path, json={"abort_all": True}, timeout=10)
        assert response.status_code == 401, (path, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_the_user_key_generates_but_changes_nothing(stack):
    response = httpx.post(stack + "/v1/chat/completions", json=CHAT, headers=bearer(USER_KEY), timeout=30)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]
    generated = httpx.post(stack + "/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}},
                           headers={"x-api-key": USER_KEY}, timeout=30)
    assert generated.status_code == 200 and len(generated.json()["output_ids"]) == 2
    for method, path in (("POST", "/flush_cache"), ("POST", "/abort_request"), ("GET", "/get_server_info"),
                         ("POST", "/pause_generation"), ("GET", "/list_weights")):
        response = httpx.request(method, stack + path, json={"abort_all": True}, headers=bearer(USER_KEY), timeout=10)
        assert response.status_code == 401 and "admin API key" in response.json()["error"]["message"], path


def test_the_admin_key_opens_admin_routes_and_generation(stack):
    assert httpx.post(stack + "/flush_cache", headers=bearer(ADMIN_KEY), timeout=10).status_code == 200
    assert httpx.post(stack + "/abort_request", json={"abort_all": True}, headers=bearer(ADMIN_KEY), timeout=10).status_code == 200
    assert httpx.post(stack + "/v1/chat/completions", json=CHAT, headers=bearer(ADMIN_KEY), timeout=30).status_code == 200


def test_health_and_metrics_stay_open(stack):
    for path in ("/health", "/metrics", "/stats"):
        assert httpx.get(stack + path, timeout=10).status_code == 200, path


def test_the_official_client_sends_its_api_key(stack):
    good = openai.OpenAI(base_url=stack + "/v1", api_key=USER_KEY, max_retries=0, timeout=30)
    assert good.chat.completions.create(**CHAT).choices[0].finish_reason == "length"
    assert [m.id for m in good.models.list().data] == ["SmolLM2-135M-Instruct"]
    bad = openai.OpenAI(base_url=stack + "/v1", api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(**CHAT)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


def test_no_secret_in_server_info_logs_or_arguments(keyed):
    up, stack = keyed
    info = httpx.get(stack + "/get_server_info", headers=bearer(ADMIN_KEY), timeout=10)
    assert info.status_code == 200 and info.json()["config"]["redis"]["url"].startswith("redis://keys-test-")
    assert ":***@" in info.json()["config"]["redis"]["url"]
    shown = info.text + up.log()  # every service's log lines, as `jaxstream up` relays them
    assert "keys: generation routes take the user key, admin routes the admin key" in shown
    assert not [s for s in SECRETS if s in shown]
    pids = children_of(up.pid).values()
    assert len(pids) == 5
    for pid in pids:  # the keys came through the environment, not arguments
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert USER_KEY not in cmdline and ADMIN_KEY not in cmdline



def test_jaxstream_bench_sends_the_key_from_the_environment(stack, tmp_path, monkeypatch, capsys):
    from stack.bench import main as bench

    args = ["--base-url", stack, "--concurrency", "1", "--num-prompts", "2", "--output-len", "2", "--prompt-format", "ids",
            "--input-len", "4", "--warmup", "0", "--json", str(tmp_path / "out.json")]
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert bench(args) == 1 and f"wants an API key: set ${API_KEY_ENV}" in capsys.readouterr().err
    monkeypatch.setenv(API_KEY_ENV, USER_KEY)
    assert bench(args) == 0
