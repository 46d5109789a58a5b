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


def test_a_start_that_does_not_finish_says_which_roles_are_not_up_with_their_last_phase(capsys):
    # The dp2 start that waited ten minutes saying nothing: now, every supervisor.start_report_s,
    # what /health says is missing, each with its last phase or "not running".
    stack = Stack(load_config(["worker=fake", "parallelism=dp2", "supervisor.start_report_s=30"]), [])
    body = {"status": "starting", "missing": ["worker.0", "tokenizer"],
            "starting": {"worker.0": "reading the tokenizer's vocabulary size"}}
    stack.report_not_up(stack.started + 29, body)
    assert capsys.readouterr().err == ""  # within the bound: nothing yet
    stack.report_not_up(stack.started + 30, body)
    assert capsys.readouterr().err == ("jaxstream: not ready 30 s after start: worker.0 (starting: reading the "
                                       "tokenizer's vocabulary size), tokenizer (not running)\n")
    stack.report_not_up(stack.started + 45, None)
    assert capsys.readouterr().err == ""  # once every 30 s
    stack.report_not_up(stack.started + 61, None)
    assert capsys.readouterr().err == "jaxstream: not ready 61 s after start: the gateway does not answer /health yet\n"
    assert launcher.not_up({"status": "unhealthy", "missing": [], "starting": {},
                            "stalled": {"scheduler.1": "no step result for 75 s with steps in flight"}}) == \
        "scheduler.1 (stalled: no step result for 75 s with steps in flight)"
