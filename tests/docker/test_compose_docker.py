"""`docker compose up` for real: build the image, start the stack, serve a chat, see every
container's health check pass, scale the tokenizer to 3, kill a container and see it restarted,
then `docker compose down -v`.

Marked `docker`; skips, saying why, where no Docker daemon answers or no Compose (`docker compose`
or `docker-compose`) is installed, as in CI. The images come from the environment:
- BASE_IMAGE: the Dockerfile's base (default python:3.11-slim). Where no registry is reachable,
  build one locally: `debootstrap --variant=minbase bookworm /tmp/rootfs http://deb.debian.org/debian`,
  then `tar -C /tmp/rootfs -c . | docker import - jaxstream-base:bookworm` (the Dockerfile installs
  python3 with apt-get); behind a TLS-intercepting proxy, copy its CA bundle into the rootfs and
  add `-c "ENV PIP_CERT=/etc/ssl/<bundle>"` to the import. The build uses the host's network.
- REDIS_IMAGE: default redis:7 when present or pullable, else tests/docker/redis.Dockerfile built
  on BASE_IMAGE (Debian's redis-server).
The first start compiles the worker's step shapes into the (new) cache volume: minutes on CPU.
"""

import json
import os
import secrets
import shutil
import subprocess
import time

import httpx
import openai
import pytest

from jaxstream.redis_server import free_port
from tests.compose import ROOT
from tests.support import healthy, wait_for

pytestmark = pytest.mark.docker
IMAGE = "jaxstream:compose-test"


def docker(*args: str, check: bool = True, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert not check or result.returncode == 0, f"docker {' '.join(args)}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    return result


def compose_binary() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


@pytest.fixture(scope="module")
def compose():
    if not shutil.which("docker"):
        pytest.skip("no docker client on PATH")
    info = subprocess.run(["docker", "info"], capture_output=True, text=True)
    if info.returncode != 0:
        pytest.skip(f"no Docker daemon reachable: {info.stderr.strip()[:200]}")
    binary = compose_binary()
    if binary is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    base = os.environ.get("BASE_IMAGE", "python:3.11-slim")
    started = time.monotonic()
    docker("build", "--network", "host", "--build-arg", f"BASE_IMAGE={base}", "-t", IMAGE, str(ROOT), timeout=1800)
    print(f"image built in {time.monotonic() - started:.0f} s")
    redis_image = os.environ.get("REDIS_IMAGE")
    if not redis_image:
        redis_image = "redis:7"
        if docker("image", "inspect", redis_image, check=False).returncode and docker("pull", redis_image, check=False).returncode:
            redis_image = "jaxstream-test-redis:local"
            docker("build", "--network", "host", "--build-arg", f"BASE_IMAGE={base}", "-t", redis_image,
                   "-f", str(ROOT / "tests/docker/redis.Dockerfile"), str(ROOT / "tests/docker"), timeout=900)
    project = f"jaxstream-test-{secrets.token_hex(4)}"
    port = free_port()
    env = {**os.environ, "JAXSTREAM_IMAGE": IMAGE, "REDIS_IMAGE": redis_image, "JAXSTREAM_PORT": str(port),
           "JAXSTREAM_REDIS_PASSWORD": secrets.token_hex(16), "BASE_IMAGE": base}

    def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        result = subprocess.run([*binary, "-p", project, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=timeout)
        assert result.returncode == 0, f"compose {' '.join(args)}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        return result

    run.base_url = f"http://127.0.0.1:{port}"
    run.project = project
    try:
        yield run
    finally:
        logs = subprocess.run([*binary, "-p", project, "logs", "--tail", "30"], cwd=ROOT, env=env, capture_output=True,
                              text=True).stdout
        run("down", "-v", "--timeout", "45")
        print(logs[-6000:])


def containers(project: str, service: str) -> list[dict]:
    ids = docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={project}",
                 "--filter", f"label=com.docker.compose.service={service}").stdout.split()
    return json.loads(docker("inspect", *ids).stdout) if ids else []


def chat(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=8,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert reply.usage.completion_tokens >= 1 and reply.choices[0].message.content


SERVICES = ("redis", "gateway", "tokenizer", "scheduler", "worker", "detokenizer")


def health(project: str) -> dict[str, str]:
    """Each container's health (`name`: healthy, unhealthy or starting) with its last check's output."""
    out = {}
    for service in SERVICES:
        for c in containers(project, service):
            state = c["State"].get("Health") or {"Status": "none", "Log": []}
            last = state["Log"][-1]["Output"].strip() if state["Log"] else ""
            out[c["Name"]] = f"{state['Status']}: {last}" if state["Status"] != "healthy" else "healthy"
    return out


def all_healthy(project: str) -> None:
    """Every container reports `healthy`: its check passed. "starting" is not enough: within its
    start period a check that fails every time still says "starting" (so every service but the worker
    was unhealthy unseen, its probe counting docker-init as a second service process)."""
    try:
        wait_for(lambda: set(health(project).values()) == {"healthy"}, 90, "every container to be healthy", interval=2)
    except AssertionError:
        raise AssertionError(f"not every container is healthy: {health(project)}") from None


def tokenizers_alive(base_url: str) -> int:
    return len(httpx.get(base_url + "/stats", timeout=5).json()["tokenizer"])


def test_compose_up_serves_scales_and_restarts_a_killed_container(compose):
    started = time.monotonic()
    compose("up", "-d", "--no-build")
    wait_for(lambda: healthy(compose.base_url), 1200, "the compose stack to be healthy", interval=2)
    print(f"healthy {time.monotonic() - started:.0f} s after `up`")
    chat(compose.base_url)
    all_healthy(compose.project)
    # The image's compiler built the worker's CPU kernels (else a warning: XLA's slower way)
    worker_log = compose("logs", "--no-color", "worker").stdout
    assert "the product kernel ready" in worker_log and "the attention kernel ready" in worker_log, worker_log[-3000:]

    compose("up", "-d", "--no-build", "--scale", "tokenizer=3")
    wait_for(lambda: tokenizers_alive(compose.base_url) == 3, 180, "three tokenizers heartbeating", interval=1)
    chat(compose.base_url)

    # A crash, as the kernel's OOM killer would do it: SIGKILL to the container's process from
    # outside. (`docker kill` counts as a deliberate stop, which `unless-stopped` respects.)
    victim = containers(compose.project, "tokenizer")[0]
    os.kill(victim["State"]["Pid"], 9)
    restarted = wait_for(lambda: (c := json.loads(docker("inspect", victim["Id"]).stdout)[0])["RestartCount"] > victim["RestartCount"]
                         and c["State"]["Running"] and c, 120, "the killed tokenizer to be restarted", interval=1)
    assert restarted["State"]["Pid"] != victim["State"]["Pid"]
    wait_for(lambda: tokenizers_alive(compose.base_url) == 3 and healthy(compose.base_url), 180,
             "the restarted tokenizer to heartbeat again", interval=1)
    chat(compose.base_url)
    all_healthy(compose.project)  # the scaled and the restarted ones too
