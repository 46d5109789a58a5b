"""Where keys come from (environment or a file, never an override) and how secrets stay out of
what the server shows: the Redis password masked in /get_server_info's config and `jaxstream config`."""

import pytest

from jaxstream.config import ConfigError, ServerConfig, load_config
from jaxstream.keys import ADMIN_API_KEY_ENV, API_KEY_ENV, Keys, load_keys, matches, public_config, redact_url
from stack.cli import main as jaxstream


def test_keys_come_from_the_environment():
    keys = load_keys(ServerConfig(), {API_KEY_ENV: "user-k", ADMIN_API_KEY_ENV: " admin-k\n"})
    assert (keys.user, keys.admin) == ("user-k", "admin-k")
    # an empty variable is unset, as vLLM's VLLM_API_KEY
    assert load_keys(ServerConfig(), {API_KEY_ENV: "", ADMIN_API_KEY_ENV: "  "}) == Keys()
    assert not load_keys(ServerConfig(), {}).any


def test_keys_come_from_the_first_line_of_a_file(tmp_path):
    (tmp_path / "user").write_text("user-k\nsecond line ignored\n")
    (tmp_path / "admin").write_text("  admin-k  \n")
    keys = load_keys(ServerConfig(api_key_file=str(tmp_path / "user"), admin_api_key_file=str(tmp_path / "admin"),
                                  health_needs_key=True), {})
    assert keys == Keys("user-k", "admin-k", health_needs_key=True)


@pytest.mark.parametrize("content,env,message", [
    (None, {}, "server.api_key_file: cannot read"),
    ("", {}, "is empty (the key is its first line)"),
    ("\nkey on the second line\n", {}, "is empty"),
    ("user-k", {API_KEY_ENV: "other"}, "given both there and in $JAXSTREAM_API_KEY; keep one"),
])
def test_a_key_file_that_cannot_give_one_key_fails_naming_the_config_key(tmp_path, content, env, message):
    path = tmp_path / "key"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match="^server.api_key_file: ") as info:
        load_keys(ServerConfig(api_key_file=str(path)), env)
    assert message in str(info.value) and "other" not in str(info.value)


def test_a_key_is_never_shown_by_repr():
    shown = repr(Keys("user-secret", "admin-secret"))
    assert "secret" not in shown and shown.count("***") == 2


def test_keys_compare_whole_and_exact():
    assert matches("abc", "abc")
    assert not matches("abd", "abc") and not matches("ab", "abc") and not matches("abcd", "abc") and not matches("", "abc")
    assert matches("clé".encode().decode("latin-1"), "clé")  # a header's latin-1 text holds the UTF-8 bytes sent


@pytest.mark.parametrize("url,shown", [
    ("redis://:pw@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    ("redis://alice:p%40ss@redis:6379/0", "redis://alice:***@redis:6379/0"),
    ("rediss://alice@redis:6379", "rediss://alice@redis:6379"),  # a user alone is no secret
    ("redis://redis:6379/0?password=pw&db=1", "redis://redis:6379/0?password=***&db=1"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    (None, None),
])
def test_redis_urls_are_shown_without_their_password(url, shown):
    assert redact_url(url) == shown


def test_the_config_shown_masks_the_redis_password():
    cfg = load_config(["redis.url=redis://jax:hunter2@10.0.0.5:6379/0", "server.api_key_file=/run/secrets/key"])
    shown = public_config(cfg)
    assert shown["redis"]["url"] == "redis://jax:***@10.0.0.5:6379/0"
    assert shown["server"]["api_key_file"] == "/run/secrets/key"  # a path, not the key
    assert cfg.redis.url.endswith("hunter2@10.0.0.5:6379/0")  # the config itself keeps it, to connect


def test_jaxstream_config_and_help_never_print_a_secret(capsys):
    assert jaxstream(["config", "redis.url=redis://:hunter2@127.0.0.1:6379/0"]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out and "url: redis://:***@127.0.0.1:6379/0" in out
    assert jaxstream(["up", "--help"]) == 0
    text = capsys.readouterr().out
    assert "server.api_key_file" in text and "$JAXSTREAM_API_KEY" in text and "$JAXSTREAM_ADMIN_API_KEY" in text


@pytest.mark.parametrize("override,where", [("server.api_key=hunter2", "JAXSTREAM_API_KEY"),
                                            ("server.admin_api_key=hunter2", "JAXSTREAM_ADMIN_API_KEY")])
def test_a_key_given_as_an_override_is_refused_without_echoing_it(override, where, capsys):
    with pytest.raises(ConfigError) as info:
        load_config([override])
    assert "never given on the command line" in str(info.value) and where in str(info.value)
    assert jaxstream(["up", override]) == 2
    assert "hunter2" not in capsys.readouterr().err and "hunter2" not in str(info.value)
