"""stack/launcher.py: how `jaxstream up` reads /health while the stack starts, and what it checks first."""

import socket
import threading

import pytest

from jaxstream.config import ConfigError, load_config
from stack import launcher
from stack.launcher import Stack


def test_something_that_does_not_speak_http_on_the_port_is_no_health_answer():
    # Seen in CI: the embedded Redis had been given the gateway's port, and `jaxstream up` died of
    # http.client.BadStatusLine on Redis's "-ERR ..." instead of waiting.
    with socket.create_server(("127.0.0.1", 0)) as server:
        def answer() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(b"-ERR wrong number of arguments for 'get' command\r\n")

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        stack = Stack(load_config(["worker=fake", f"server.port={server.getsockname()[1]}"]), [])
        assert stack.missing() is None
        thread.join(5)


def test_up_checks_the_model_before_it_takes_the_port_or_starts_redis(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("something started before the model's files were checked")

    monkeypatch.setattr(launcher, "listen", started)
    monkeypatch.setattr(launcher, "EmbeddedRedis", started)
    with pytest.raises(ConfigError, match=r"^parallelism\.tensor: 2 does not divide model heads 9 "):
        launcher.up(["parallelism=tp2"])  # SmolLM2's 9 heads, read from its GGUF's header
