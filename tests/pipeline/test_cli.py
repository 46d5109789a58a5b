"""`jaxstream up` as a user runs it: embedded Redis, readiness, child death, bad config."""

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from jaxstream.redis_server import free_port
from tests.support import ROOT, children_of, start_up, wait_for

pytestmark = pytest.mark.pipeline


def test_up_with_embedded_redis_serves_then_exits_nonzero_naming_a_dead_child():
    up, base_url = start_up(None, "--restart=never", "worker=fake")  # no redis.url: the embedded server
    try:
        assert "embedded redis-server" in up.log() and f"ready: serving SmolLM2-135M-Instruct at {base_url}" in up.log()
        for role in ("gateway", "tokenizer", "scheduler", "worker", "detokenizer"):
            assert f"jaxstream: {role} up after " in up.log() and f"[{role}]" in up.log()
        assert "libtpu" not in up.log()
        r = httpx.post(base_url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        children = children_of(up.pid)
        assert set(children) == {"gateway", "tokenizer_svc", "scheduler_svc", "worker_svc", "detokenizer_svc"}
        subprocess.run(["kill", "-9", str(children["worker_svc"])], check=True)
        code = up.proc.wait(20)
    finally:
        if up.alive():
            up.stop()
    assert code == 1
    assert "worker exited with code -9; stopping the stack" in up.log()
    wait_for(lambda: not children_of(up.pid), 10, "every child to be gone")


@pytest.mark.parametrize("override,key", [("scheduler.page_size=0", "scheduler.page_size"),
                                          ("+server.nope=1", "server.nope"),
                                          ("server.api_key_file=/nonexistent/key", "server.api_key_file")])
def test_up_refuses_a_bad_config_naming_the_key(override, key):
    r = subprocess.run([sys.executable, "-m", "stack", "up", override], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and key in r.stderr and "config error" in r.stderr


@pytest.mark.parametrize("module", ["scheduler_svc", "gateway"])
def test_a_service_alone_refuses_a_bad_config(module):
    r = subprocess.run([sys.executable, "-m", module, "scheduler.max_running_requests=-3"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "scheduler.max_running_requests" in r.stderr


def test_a_service_alone_without_redis_url_says_so():
    r = subprocess.run([sys.executable, "-m", "scheduler_svc"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "redis.url" in r.stderr


def test_sigterm_stops_everything_and_exits_zero():
    up, base_url = start_up(None, "worker=fake")
    children = children_of(up.pid)
    # The embedded Redis's random password reaches every service by environment, never by argument
    environ = Path(f"/proc/{children['gateway']}/environ").read_bytes().split(b"\0")
    password = next(e.split(b"=", 1)[1] for e in environ if e.startswith(b"JAXSTREAM_REDIS_PASSWORD="))
    assert len(password) == 32 and password not in up.log().encode()
    for pid in children.values():
        assert password not in Path(f"/proc/{pid}/cmdline").read_bytes()
    up.signal(signal.SIGTERM)
    assert up.proc.wait(20) == 0
    assert "jaxstream: stopped" in up.log()
    for pid in children.values():
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_ctrl_c_in_a_terminal_stops_everything_cleanly():
    """The whole process group gets SIGINT, the embedded Redis's too unless it left the group: it
    must outlive the services' shutdown (which still talks to it), so no service dies of a lost Redis."""
    up, base_url = start_up(None, "worker=fake", own_group=True)
    up.interrupt()
    assert up.proc.wait(20) == 0
    assert "jaxstream: stopped" in up.log() and "Traceback" not in up.log(), up.log()[-3000:]


def test_a_service_refusing_its_config_stops_the_stack_at_once_saying_why():
    # Caught only where a service reads the tokenizer (its vocabulary against the model's): no restart mends it.
    r = subprocess.run([sys.executable, "-m", "stack", "up", "worker=fake", "+model.hf_config.vocab_size=10",
                        f"server.port={free_port()}"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "refused its config" in r.stderr and "model.hf_config.vocab_size: 10 is less than the 49152 tokens" in r.stderr, r.stderr[-2000:]
    assert "restarting" not in r.stderr


@pytest.mark.parametrize("override,line", [
    ("model.path=/nonexistent", "model.path: '/nonexistent' does not exist"),
    ("parallelism=tp2", "parallelism.tensor: 2 does not divide model heads 9 (num_attention_heads of "),  # SmolLM2's
])
def test_up_refuses_what_only_the_model_shows_in_one_line_before_starting_anything(override, line):
    """The worker would find these only after Redis and every service had started (jaxstream/preflight.py)."""
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "stack", "up", override, f"server.port={free_port()}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and time.monotonic() - started < 20, r.stderr[-2000:]
    assert r.stderr.startswith(f"jaxstream: config error: {line}"), r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and not r.stdout, r.stderr  # nothing started: no redis, no service


@pytest.mark.parametrize("module,role", [("gateway", "gateway"), ("tokenizer_svc", "tokenizer"), ("scheduler_svc", "scheduler"),
                                         ("worker_svc", "worker"), ("detokenizer_svc", "detokenizer")])
def test_each_service_alone_refuses_what_only_the_model_shows_before_it_connects(module, role):
    # No redis.url: a service that got as far as connecting would say so instead.
    r = subprocess.run([sys.executable, "-m", module, "parallelism=tp2"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith(f"{role}: config error: parallelism.tensor: 2 does not divide model heads 9")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_up_on_a_busy_port_says_so_at_once_without_starting_anything():
    """The default worker (JAX) is never started: the port is checked first."""
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        started = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "stack", "up", f"server.port={port}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and time.monotonic() - started < 10, r.stderr
    assert f"127.0.0.1:{port} is already in use" in r.stderr and f"server.port={port + 1}" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not r.stdout, r.stderr  # nothing started: no redis, no service


def test_the_gateway_alone_on_a_busy_port_says_so_without_a_traceback(redis_url):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "gateway", f"redis.url={redis_url}", f"server.port={port}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"127.0.0.1:{port} is already in use" in r.stderr and "server.port=" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr
