"""The Compose files are valid Compose, and what they configure is a config the services accept.

Validated against the compose-spec JSON schema (tests/docker/compose-spec.json, vendored from
compose-spec/compose-spec's schema/compose-spec.json), which CI can do without Docker; where a
`docker compose` or `docker-compose` binary is on PATH, its own `config` check runs as well.
"""

import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest

from jaxstream.config import load_config
from tests.compose import COMPOSE_FILES, MODULES, ROOT, interpolate, load

SCHEMA = json.loads((Path(__file__).resolve().parent.parent / "docker" / "compose-spec.json").read_text())
SECRET = "s3cret-in-the-environment"
ENV = {"JAXSTREAM_REDIS_PASSWORD": SECRET}


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_each_compose_file_follows_the_compose_spec(name):
    jsonschema.Draft7Validator(SCHEMA).validate(load(name))


def compose_commands():
    """(file, compose service, module, overrides) of every service of ours in every file."""
    for name in COMPOSE_FILES:
        for service, spec in load(name)["services"].items():
            if "command" in spec and service != "redis":
                command = [interpolate(arg, ENV) for arg in spec["command"]]
                assert command[:2] == ["python", "-m"], (name, service, command)
                yield name, service, command[2], command[3:]


@pytest.mark.parametrize("name,service,module,overrides", list(compose_commands()),
                         ids=lambda v: v if isinstance(v, str) and "=" not in v else None)
def test_every_command_composes_a_valid_config_for_its_role(name, service, module, overrides):
    assert module == MODULES[service.split("-")[0]]  # scheduler-1 runs scheduler_svc
    cfg = load_config(overrides)
    assert cfg.redis.url == "redis://redis:6379/0"  # the compose network's Redis; no password in the URL
    if module == "gateway":
        assert cfg.server.host == "0.0.0.0"  # reachable through the published port


def test_dp2_gives_every_service_the_replica_count_and_each_pair_its_replica():
    replicas = {}
    for name, service, module, overrides in compose_commands():
        if name == "docker-compose.dp2.yml":
            cfg = load_config(overrides)
            assert cfg.parallelism.data == 2, service
            if module in ("scheduler_svc", "worker_svc"):
                replicas.setdefault(module, set()).add(cfg.parallelism.replica)
    assert replicas == {"scheduler_svc": {0, 1}, "worker_svc": {0, 1}}


def test_the_redis_password_is_in_no_command_line():
    for name in COMPOSE_FILES:
        for service, spec in load(name)["services"].items():
            command = " ".join(interpolate(arg, ENV) for arg in spec.get("command", []))
            assert SECRET not in command, (name, service)
    _, env = load()["services"]["worker"]["command"], load()["services"]["worker"]["environment"]
    assert interpolate(env["JAXSTREAM_REDIS_PASSWORD"], ENV) == SECRET  # it travels in the environment


def test_the_stateless_roles_scale():
    """`--scale tokenizer=3`: no fixed container name or host port to collide on."""
    services = load()["services"]
    for service in ("tokenizer", "detokenizer", "scheduler", "worker"):
        assert "container_name" not in services[service] and "ports" not in services[service], service
        assert services[service]["restart"] == "unless-stopped"
    assert services["gateway"]["restart"] == "unless-stopped"


def compose_binary() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return [shutil.which("docker-compose")] if shutil.which("docker-compose") else None


@pytest.mark.parametrize("overlay", [(), ("docker-compose.gpu.yml",), ("docker-compose.dp2.yml",)])
def test_docker_compose_config_accepts_the_files(overlay):
    binary = compose_binary()
    if binary is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed (the schema test above still ran)")
    files = [arg for name in ("docker-compose.yml", *overlay) for arg in ("-f", str(ROOT / name))]
    result = subprocess.run([*binary, *files, "config", "--quiet"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
