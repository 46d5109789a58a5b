import pytest
from flax import nnx

from tests import background
from tests.background import BackgroundRuns
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
    e.executables.compile_all(progress=False)
    return e


@pytest.fixture(scope="session")
def fake_device_runs() -> BackgroundRuns:
    """The fake-device scripts' runs, started at the session's start (tests/conftest.py)."""
    return background.runs()
