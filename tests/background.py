"""Scripts the suite runs in the background, each in a process of its own, whose output tests read
last:
- the fake-device scripts (tests/worker/tp_check.py, int8_check.py, swap_check.py: XLA_FLAGS must be
  set before jax starts), tests/model/gpt_oss_tp.py (GPT-OSS's shards against transformers),
  deepseek_moe_ep.py (DeepSeek's MoE layer with its experts split, against transformers) and deepseek_tp.py
  (the DeepSeek models' shards and batch_invariant against transformers), lora_tp.py (LoRA adapters
  under tp2 against peft), hybrid_tp.py (the hybrids' shards and batch_invariant), mostly compiling; and
  invariant_check.py, which needs no fake devices but
  compiles as much (batch_invariant on every family served since Qwen3), run as they are;
- the model families each through a whole stack (tests/pipeline/family_stacks.py), which needs no
  fake devices: its stacks' services are processes of their own.

tests/conftest.py starts a script once collection is over, when a collected test asks for its
fixture, at the lowest priority (nice 19): they run in the time the suite's earlier tests leave the
CPU idle (the pipeline tests mostly wait on their services), and barely slow those tests down. The
tests that read them come last (tests/worker/, and the family stacks' after every other), by when
they are done or nearly so. Measured on this 2-core machine: the suite waited ~125 s for the
fake-device scripts when the first test that needed them started them.

The scripts share one JAX compilation cache on disk, new each session (as pytest's process has its
own: tests/conftest.py): each builds engine after engine, whose samplers, penalties and masks are
mostly the same programs from one engine to the next: compiled once, not once an engine. A hit still
counts as a compile for worker_svc.compiles, so the scripts that count compiles see the same numbers.
The family stacks' workers set their own (worker.compile_cache_dir) over it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKE_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
# JAX reads its options from these at start; every program cached, however quick it was to compile
COMPILE_CACHE = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


@dataclass(frozen=True)
class Script:
    module: str  # run as `python -m module`
    fixture: str  # the fixture of the tests that read it: a collected test asking for it starts it
    env: dict[str, str] = field(default_factory=dict)  # over the suite's environment


SCRIPTS = {
    "tp_check": Script("tests.worker.tp_check", "fake_device_runs", FAKE_DEVICES),
    "int8_check": Script("tests.worker.int8_check", "fake_device_runs", FAKE_DEVICES),
    "swap_check": Script("tests.worker.swap_check", "fake_device_runs", FAKE_DEVICES),
    "invariant_check": Script("tests.worker.invariant_check", "fake_device_runs", FAKE_DEVICES),
    "gpt_oss_tp": Script("tests.model.gpt_oss_tp", "gpt_oss_sharded_runs", FAKE_DEVICES),
    "deepseek_moe_ep": Script("tests.model.deepseek_moe_ep", "deepseek_moe_sharded_runs", FAKE_DEVICES),
    "deepseek_tp": Script("tests.model.deepseek_tp", "deepseek_sharded_runs", FAKE_DEVICES),
    "lora_tp": Script("tests.model.lora_tp", "lora_sharded_runs", FAKE_DEVICES),
    "hybrid_tp": Script("tests.model.hybrid_tp", "hybrid_sharded_runs", FAKE_DEVICES),
    "family_stacks": Script("tests.pipeline.family_stacks", "family_stack_runs"),
}
_runs: BackgroundRuns | None = None


class BackgroundRuns:
    """Each script's output goes to a file, not a pipe: a pipe nobody reads yet (the script waited
    for last) would fill and stop its writer."""

    def __init__(self) -> None:
        self.outputs: dict[str, tuple] = {}
        self.processes: dict[str, subprocess.Popen] = {}
        self.compile_cache = tempfile.mkdtemp(prefix="jaxstream-background-xla-")  # the scripts' one, removed by close

    def start(self, name: str) -> None:
        if name in self.processes:
            return
        script = SCRIPTS[name]
        nice = [found, "-n", "19"] if (found := shutil.which("nice")) else []
        out, err = self.outputs[name] = (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+"))
        env = {**os.environ, **COMPILE_CACHE, "JAX_COMPILATION_CACHE_DIR": self.compile_cache, **script.env}
        self.processes[name] = subprocess.Popen([*nice, sys.executable, "-m", script.module], cwd=ROOT, env=env, text=True,
                                                stdout=out, stderr=err, stdin=subprocess.DEVNULL)

    def stdout(self, name: str, timeout: float = 400) -> str:
        """The script's standard output once it has exited 0 (its standard error's end otherwise)."""
        self.start(name)  # already, unless the hook did not run
        code = self.processes[name].wait(timeout=timeout)
        out, err = self.outputs[name]
        out.seek(0), err.seek(0)
        assert code == 0, err.read()[-3000:]
        return out.read()

    def arrays(self, name: str) -> dict:
        """The arrays a script saved (an .npz it names last on its standard output, in a temporary
        directory of its own, removed once read)."""
        import numpy as np

        results = Path(self.stdout(name).split()[-1])
        saved = dict(np.load(results))
        shutil.rmtree(results.parent)
        return saved

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        for files in self.outputs.values():
            for f in files:
                f.close()
        shutil.rmtree(self.compile_cache, ignore_errors=True)


def start(fixtures: set[str]) -> None:
    """Start every script that a test asking for one of `fixtures` reads."""
    for name, script in SCRIPTS.items():
        if script.fixture in fixtures:
            runs().start(name)


def runs() -> BackgroundRuns:
    global _runs
    if _runs is None:
        _runs = BackgroundRuns()
    return _runs


def stop() -> None:
    global _runs
    if _runs is not None:
        _runs.close()
        _runs = None
