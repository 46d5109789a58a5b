"""`jaxstream up` for the benchmark scripts: started with overrides on a free port, waited for until
/health answers, stopped at the end."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxstream.redis_server import free_port  # noqa: E402


@contextmanager
def jaxstream_up(overrides: list[str], timeout_s: float = 900) -> Iterator[str]:
    """Yields the base URL. `timeout_s`: the JAX worker compiles its step shapes before /health."""
    base_url = f"http://127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "stack", "up", *overrides, f"server.port={base_url.rsplit(':', 1)[1]}"]
    with server(command, base_url + "/health", timeout_s):
        yield base_url


@contextmanager
def server(command: list[str], ready_url: str, timeout_s: float) -> Iterator[None]:
    """Run `command` (from the repository root) until the block ends, entered once `ready_url`
    answers 200; if it exits or is not ready in time, stop with its command and its output's tail."""
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout_s
            while not _answers(ready_url):
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    sys.exit(f"{' '.join(command)} did not become ready ({ready_url}):\n" + "".join(log.readlines()[-20:]))
                time.sleep(0.2)
            yield
        finally:
            process.terminate()
            process.wait(60)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
