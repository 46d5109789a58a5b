import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from flax import nnx

from worker_svc.batch import Buckets
from worker_svc.engine import Engine
from worker_svc.models.llama import Llama, LlamaConfig

TINY = LlamaConfig(vocab=101, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp_dim=48,
                   rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True)
PAGE_SIZE = 4
NUM_PAGES = 96
# Small buckets, so steps get split and padded in every way a real worker sees: steps of up to 4
# tokens read their cache through page lists, larger ones through pairs (both attention layouts).
BUCKETS = Buckets(tokens=(1, 2, 4, 8, 16), pairs=(0, 16, 64), max_rows=8, max_pages=32, page_list_tokens=4)


def tiny_engine(buckets: Buckets = BUCKETS, cfg: LlamaConfig = TINY, salt: int = 0) -> Engine:
    return Engine(Llama(cfg, rngs=nnx.Rngs(0)), buckets, PAGE_SIZE, NUM_PAGES, salt)


@pytest.fixture(scope="session")
def engine() -> Engine:
    """Compiled once for every test module here (a compile_all costs ~25 s on a laptop CPU)."""
    e = tiny_engine()
    e.compile_all(progress=False)
    return e


# Scripts that need fake CPU devices (XLA_FLAGS must be set before jax starts, so each runs in a
# process of its own). They spend most of their time compiling, on one core, so the first test that
# needs one starts them all at once, and the others' results are ready or nearly so when asked for:
# on a 2-core CI machine this overlaps ~80 s of compiling with the rest of the suite.
FAKE_DEVICE_SCRIPTS = ("tp_check", "int8_check", "swap_check")


class FakeDeviceRuns:
    """Each script's output goes to a file, not a pipe: a pipe nobody reads yet (the script waited
    for last) would fill and stop its writer."""

    def __init__(self) -> None:
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
        root = Path(__file__).resolve().parents[2]
        self.outputs = {name: (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for name in FAKE_DEVICE_SCRIPTS}
        self.processes = {name: subprocess.Popen([sys.executable, "-m", f"tests.worker.{name}"], cwd=root, env=env, text=True,
                                                 stdout=out, stderr=err) for name, (out, err) in self.outputs.items()}

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


@pytest.fixture(scope="session")
def fake_device_runs():
    runs = FakeDeviceRuns()
    yield runs
    runs.close()
