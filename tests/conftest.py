import os

import pytest

from jaxstream.config import ModelConfig
from jaxstream.model_files import TokenizerInfo, load_tokenizer
from jaxstream.redis_server import EmbeddedRedis


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
