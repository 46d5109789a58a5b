"""stack/probe.py finds the one service process in its container from /proc, as compose's health check runs it."""

from pathlib import Path

import pytest

from stack.probe import service_command


def fake_proc(tmp_path: Path, processes: dict[int, list[str]]) -> Path:
    for pid, argv in processes.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (tmp_path / "self").mkdir()  # not a process directory with a cmdline: skipped
    return tmp_path


def test_under_compose_init_the_service_is_found_not_docker_init_carrying_its_command(tmp_path):
    service = ["python", "-m", "tokenizer_svc", "redis.url=redis://redis:6379/0"]
    proc = fake_proc(tmp_path, {1: ["/sbin/docker-init", "--", *service], 7: service, 90: ["sh", "-c", "sleep 1"]})
    assert service_command(proc) == ["tokenizer_svc", "redis.url=redis://redis:6379/0"]


def test_a_venv_interpreter_with_flags_is_a_service_process(tmp_path):
    proc = fake_proc(tmp_path, {12: ["/opt/venv/bin/python3", "-u", "-m", "worker_svc", "worker.compile_cache_dir=/cache/xla"]})
    assert service_command(proc) == ["worker_svc", "worker.compile_cache_dir=/cache/xla"]


def test_no_service_or_two_of_them_is_a_lookup_error_saying_how_many(tmp_path):
    none, two = tmp_path / "none", tmp_path / "two"
    none.mkdir()
    two.mkdir()
    with pytest.raises(LookupError, match="found 0"):
        service_command(fake_proc(none, {5: ["sh", "-c", "sleep 1"]}))
    with pytest.raises(LookupError, match="found 2"):
        service_command(fake_proc(two, {3: ["python", "-m", "gateway"], 4: ["python", "-m", "scheduler_svc"]}))
