"""A built, non-editable install serves on its own, run from a directory that is not the checkout.

1. The wheel is built as `python -m build` builds it: an sdist of the checkout, then a wheel from the
   sdist, so a file either one leaves out (configs/ was) is missing here too.
2. It goes into a fresh venv that sees this environment's dependencies (no downloads) through a .pth
   listing its site-packages directories. A .pth's lines only put directories on sys.path; the .pth
   files inside them do not run, so the editable install of the checkout (a .pth that appends an
   import finder mapping `jaxstream`, `stack`, ... to the checkout) is not active in the venv. With
   `--system-site-packages` it would be: the wheel's modules would still come first, but any module the
   wheel lacked would be imported silently from the checkout, the very gap this test is here to find.
3. From an empty directory, the venv's `jaxstream up worker=fake` serves a completion and stops cleanly.
"""

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT, child_pid, healthy, start_up

pytestmark = pytest.mark.pipeline

PACKAGES = ("jaxstream", "stack", "gateway", "tokenizer_svc", "scheduler_svc", "worker_svc", "detokenizer_svc")

# Where each import comes from, as the venv's python sees it.
PROBE = f"""
import importlib, json, sys
import jaxstream.config
print(json.dumps({{
    "files": [importlib.import_module(p).__file__ for p in {PACKAGES!r}],
    "config_dir": str(jaxstream.config.CONFIG_DIR),
    "finders": [getattr(f, "__module__", "") or type(f).__module__ for f in sys.meta_path],
    "path": sys.path,
}}))
"""


def run(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def dependency_dirs() -> list[str]:
    """This interpreter's site-packages directories (its user site's too, where it has one)."""
    dirs = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    return [d for d in dirs if Path(d).is_dir() and not Path(d).resolve().is_relative_to(ROOT)]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """(the venv, an empty working directory, the environment to run its commands in)."""
    tmp = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env |= {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}  # offline: everything is here
    dist, venv, work = tmp / "dist", tmp / "venv", tmp / "work"
    work.mkdir()
    build_sdist = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    sdist = dist / run([sys.executable, "-c", build_sdist, str(dist)], ROOT, env).splitlines()[-1]
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", str(sdist), "-w", str(dist)], tmp, env)
    (wheel,) = dist.glob("jaxstream-*.whl")
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp, env)
    python = str(venv / "bin" / "python")
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], work, env).strip()
    (Path(purelib) / "_dependencies.pth").write_text("\n".join(dependency_dirs()) + "\n")
    # --ignore-installed: the editable install's metadata is visible; the wheel goes into the venv anyway.
    run([python, "-m", "pip", "install", "--no-deps", "--ignore-installed", str(wheel)], work, env)
    return venv, work, env


def test_the_venv_imports_the_wheel_not_the_checkout(installed):
    venv, work, env = installed
    seen = json.loads(run([str(venv / "bin" / "python"), "-c", PROBE], work, env))
    for file in [*seen["files"], seen["config_dir"]]:
        assert Path(file).is_relative_to(venv), f"{file} is not the wheel's (venv {venv})"
    assert (Path(seen["config_dir"]) / "config.yaml").is_file()
    assert not [f for f in seen["finders"] if f.startswith("__editable__")], seen["finders"]
    assert not [p for p in seen["path"] if p and Path(p).resolve().is_relative_to(ROOT)], seen["path"]


def test_the_wheels_jaxstream_up_serves_from_elsewhere_then_stops_cleanly(installed):
    venv, work, env = installed
    up, base_url = start_up(None, "worker=fake", command=(str(venv / "bin" / "jaxstream"),), cwd=work, env=env)
    try:
        assert healthy(base_url) and "embedded redis-server" in up.log()
        # Its services are the venv's python too (the launcher starts them with its own interpreter).
        gateway = child_pid(up.pid, "-m", "gateway")
        assert Path(f"/proc/{gateway}/cmdline").read_bytes().split(b"\0")[0].decode() == str(venv / "bin" / "python")
        # A text prompt: the tokenizer reads the bundled model's GGUF, found as an installed package.
        r = httpx.post(base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2 and isinstance(r.json()["choices"][0]["text"], str)
    finally:
        code = up.stop()
    assert code == 0, f"jaxstream up exited {code} on SIGTERM:\n{up.log()[-3000:]}"
    assert "Traceback" not in up.log(), up.log()[-5000:]
