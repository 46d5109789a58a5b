"""Fixtures of the modules that drive one whole stack through HTTP. Such a module defines `stack`
(its base URL) and marks itself `usefixtures("idle_after_each_test")`; modules that start and kill
services themselves (test_failures, test_cli) use none of these."""

import openai
import pytest

from tests import background
from tests.support import assert_idle, serve


@pytest.fixture(scope="session")
def fake_stack(redis_url):
    """`jaxstream up worker=fake`, shared by every module that needs nothing else. With n-gram
    speculative decoding: it must change no output, and every module then checks that it does not
    (the fake model's drafts are accepted where a prompt holds the run it counts up)."""
    yield from serve(redis_url, "worker=fake", "scheduler.speculative=ngram")


# The JAX worker on SmolLM2's real weights, small enough to compile quickly; with n-gram speculative
# decoding, which SmolLM2's repetitions often draft for, and which must change no output. Its pool is
# given as memory: 256 pages of 16 tokens at SmolLM2's 46080 bytes a token (float32), exactly
# 0.17578125 GiB, which the scheduler and the worker each size alike (test_jax_worker.py checks).
SMALL_JAX = ("scheduler.max_tokens_per_step=64", "scheduler.max_running_requests=8", "scheduler.kv_cache_memory_gib=0.17578125",
             "model.max_model_len=1024", "scheduler.speculative=ngram")


@pytest.fixture(scope="session")
def jax_stack(redis_url):
    """`jaxstream up` with the JAX worker and the real weights (SMALL_JAX), shared by the modules
    that compare against it."""
    yield from serve(redis_url, *SMALL_JAX)


@pytest.fixture
def idle_after_each_test(stack):
    """The DESIGN invariant after every test: nothing runs or waits, every page is free or held by
    the prefix cache (unpinned)."""
    yield
    assert_idle(stack)


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def family_stack_runs():
    """The family stacks' script's run, started at the session's start (tests/conftest.py)."""
    return background.runs()
