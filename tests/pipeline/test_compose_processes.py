"""docker-compose.yml's services, run as local processes: each one's `command` and `environment`
exactly as declared, against a password-protected Redis, serving a chat to the official client.
So the compose file cannot drift from what works: a renamed module, a key the services no longer
accept, a password that no longer reaches them all fail here, without Docker.

What differs from the containers, all in `local()`: `python` is this interpreter; the compose
network's `redis:6379` is the test's Redis; paths in the volumes (/cache, /models) are under a
temporary directory; the gateway gets a free port (it listens on 8000 in its container). And the
worker is the fake one (`worker=fake` appended), to keep this test a few seconds: the compose file
serves the bundled SmolLM2, which tests/docker/test_compose_docker.py serves for real.
"""

import os
import secrets
import subprocess
import sys
from urllib.parse import urlsplit

import openai
import pytest

from jaxstream.redis_server import EmbeddedRedis, free_port
from tests.compose import MODULES, load, service
from tests.support import Process, healthy, wait_for

pytestmark = pytest.mark.pipeline


def local(command: list[str], redis: EmbeddedRedis, volumes: str, port: int) -> list[str]:
    """The one place a compose command is adapted to run here (the module docstring says why)."""
    assert command[0] == "python"
    address = urlsplit(redis.url).netloc
    args = [arg.replace("redis://redis:6379/", f"redis://{address}/")
               .replace("=/cache/", f"={volumes}/cache/").replace("=/models/", f"={volumes}/models/")
            for arg in command[1:]]
    extra = [f"server.port={port}"] if args[1] == "gateway" else ["worker=fake"] if args[1] == "worker_svc" else []
    return [sys.executable, *args, *extra]


@pytest.fixture(scope="module")
def compose_redis():
    with EmbeddedRedis(password=secrets.token_hex(16)) as server:
        yield server


def test_the_compose_services_serve_a_chat_as_processes(compose_redis, tmp_path):
    compose = load()
    port = free_port()
    # Compose's own interpolation of the file, with the password and a user key set as a user would (.env).
    key = secrets.token_hex(8)
    environ = {"JAXSTREAM_REDIS_PASSWORD": compose_redis.password, "JAXSTREAM_API_KEY": key}
    procs, commands = [], {}
    try:
        for name, module in MODULES.items():
            command, environment = service(name, environ, compose)
            assert command[1:3] == ["-m", module], (name, command)
            # The password reaches every service; the keys only the gateway, which alone checks them.
            keys = {"JAXSTREAM_API_KEY": key, "JAXSTREAM_ADMIN_API_KEY": ""} if name == "gateway" else {}
            assert environment == {"JAXSTREAM_REDIS_PASSWORD": compose_redis.password, **keys}, name
            commands[name] = local(command, compose_redis, str(tmp_path), port)
            # The password only in the environment; none of the test's own in it either.
            env = {k: v for k, v in os.environ.items() if not k.startswith("JAXSTREAM_")} | environment
            procs.append(Process(commands[name], name, env=env))
        base_url = f"http://127.0.0.1:{port}"
        wait_for(lambda: healthy(base_url) or not all(p.alive() for p in procs), 60, "the compose services to be healthy",
                 interval=0.25)
        assert all(p.alive() for p in procs), "\n".join(p.log()[-2000:] for p in procs if not p.alive())

        client = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=30)
        reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4,
                                               messages=[{"role": "user", "content": "Hi"}])
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
        assert isinstance(reply.choices[0].message.content, str)

        # Each container's health check (stack.probe), given the command it would find in its container.
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAXSTREAM_")} | environ
        probes = {name: subprocess.Popen([sys.executable, "-m", "stack.probe", *commands[name][2:]], env=env,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                  for name in MODULES}
        for name, probe in probes.items():
            out = probe.communicate(timeout=60)[0]
            assert probe.returncode == 0, (name, out)
        # One that finds no instance of its role says so, and fails.
        missing = subprocess.run([sys.executable, "-m", "stack.probe", *commands["tokenizer"][2:], "redis.namespace=elsewhere"],
                                 env=env, capture_output=True, text=True, timeout=60)
        assert missing.returncode == 1 and "no heartbeat of tokenizer" in missing.stderr, missing.stderr
    finally:
        for proc in procs:  # the gateway first, as compose stops it (it depends on the rest)
            proc.stop()
    for proc in procs:
        assert "Traceback" not in proc.log(), proc.log()[-3000:]
