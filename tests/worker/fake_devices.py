"""Scripts that need fake CPU devices (XLA_FLAGS must be set before jax starts, so each runs in a
process of its own): tp_check.py, int8_check.py and swap_check.py, mostly compiling; and invariant_check.py,
which needs no fake devices but compiles as much (batch_invariant on every family served since Qwen3).

tests/conftest.py starts them once collection is over, when any collected test asks for their
results, at the lowest priority (nice 19): they run in the time the suite's earlier tests leave the
CPU idle (the pipeline tests mostly wait on their services), and barely slow those tests down. The
tests that read them come last (tests/worker/), by when they are done or nearly so. Measured on this
2-core machine: the suite waited ~125 s for them when the first test that needed them started them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPTS = ("tp_check", "int8_check", "swap_check", "invariant_check")
ROOT = Path(__file__).resolve().parents[2]
_runs: FakeDeviceRuns | None = None


class FakeDeviceRuns:
    """Each script's output goes to a file, not a pipe: a pipe nobody reads yet (the script waited
    for last) would fill and stop its writer."""

    def __init__(self) -> None:
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
        nice = [found, "-n", "19"] if (found := shutil.which("nice")) else []
        self.outputs = {name: (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for name in SCRIPTS}
        self.processes = {name: subprocess.Popen([*nice, sys.executable, "-m", f"tests.worker.{name}"], cwd=ROOT, env=env,
                                                 text=True, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
                          for name, (out, err) in self.outputs.items()}

    def stdout(self, name: str, timeout: float = 400) -> str:
        """The script's standard output once it has exited 0 (its standard error's end otherwise)."""
        code = self.processes[name].wait(timeout=timeout)
        out, err = self.outputs[name]
        out.seek(0), err.seek(0)
        assert code == 0, err.read()[-3000:]
        return out.read()

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        for files in self.outputs.values():
            for f in files:
                f.close()


def start() -> None:
    global _runs
    if _runs is None:
        _runs = FakeDeviceRuns()


def runs() -> FakeDeviceRuns:
    start()  # already, unless the hook did not run
    return _runs


def stop() -> None:
    global _runs
    if _runs is not None:
        _runs.close()
        _runs = None
