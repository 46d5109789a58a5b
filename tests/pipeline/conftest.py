"""Fixtures of the modules that drive one whole stack through HTTP. Such a module defines `stack`
(its base URL) and marks itself `usefixtures("idle_after_each_test")`; modules that start and kill
services themselves (test_failures, test_cli) use none of these."""

import json

import numpy as np
import openai
import pytest

from jaxstream.safetensors import encode
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


# Its LoRA adapter slots, which test_lora_jax uses and the other modules leave unused: a step of base
# rows alone adds exact zeros (worker_svc/layers/lora.py), so their outputs are the base model's bit
# for bit. A stack that compares with it bit for bit (test_rl_jax) has the same slots: the same executables.
JAX_LORA = ("worker.lora.max_adapters=2", "worker.lora.max_rank=4")
LORA_MODEL, LORA_RANK, LORA_ALPHA = "SmolLM2-135M-Instruct", 4, 8
LAYERS, HIDDEN, KV, MLP = 30, 576, 192, 1536  # SmolLM2-135M: 9 heads and 3 KV heads of 64
LORA_SHAPES = {"q_proj": ("self_attn", HIDDEN, HIDDEN), "v_proj": ("self_attn", HIDDEN, KV), "down_proj": ("mlp", MLP, HIDDEN)}


@pytest.fixture(scope="session")
def jax_adapter(tmp_path_factory) -> str:
    """A PEFT directory of a rank-4 adapter on q, v and down, A and B random (each moves the logits):
    jax_stack loads it at start as `start`."""
    out = tmp_path_factory.mktemp("lora")
    rng = np.random.default_rng(0)
    tensors = {}
    for module, (block, into, outto) in LORA_SHAPES.items():
        for layer in range(LAYERS):
            name = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(0, into ** -0.5, (LORA_RANK, into)).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.5 * LORA_RANK ** -0.5, (outto, LORA_RANK)).astype(np.float32)
    (out / "adapter_model.safetensors").write_bytes(encode(tensors))
    config = {"peft_type": "LORA", "r": LORA_RANK, "lora_alpha": LORA_ALPHA, "target_modules": sorted(LORA_SHAPES),
              "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": LORA_MODEL}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return str(out)


@pytest.fixture(scope="session")
def jax_stack(redis_url, jax_adapter):
    """`jaxstream up` with the JAX worker and the real weights (SMALL_JAX), shared by the modules
    that compare against it, with LoRA slots (JAX_LORA) and one adapter loaded at start."""
    yield from serve(redis_url, *SMALL_JAX, *JAX_LORA, f"+worker.lora.adapters.start={jax_adapter}")


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
