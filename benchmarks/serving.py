"""`jaxstream up` for the benchmark scripts: started with overrides on a free port, waited for until
/health answers, stopped at the end."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxstream.redis_server import free_port  # noqa: E402


@contextmanager
def stack(overrides: list[str], timeout_s: float = 900) -> Iterator[str]:
    """Yields the base URL. `timeout_s`: the JAX worker compiles its step shapes before /health."""
    base_url = f"http://127.0.0.1:{free_port()}"
    up = subprocess.Popen([sys.executable, "-m", "jaxstream", "up", *overrides, f"server.port={base_url.rsplit(':', 1)[1]}"],
                          cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(base_url):
            if up.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"jaxstream up {' '.join(overrides)} did not become healthy")
            time.sleep(0.2)
        yield base_url
    finally:
        up.terminate()
        up.wait(60)


def _healthy(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
