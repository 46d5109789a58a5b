"""A sharded model through the whole stack on a CPU: `jaxstream up model=qwen3_tiny parallelism=tp2
moe=ep` (the issue's command: a dense model, for which moe=ep changes nothing) and the MoE model over a
2 x 2 mesh with its experts exchanged by all-to-all. No XLA_FLAGS: the worker asks JAX for the CPU
devices its mesh needs (worker_svc/sharding.py, ask_for_cpu_devices). The random weights are the same
(worker.seed) as those of a single-device engine built here, whose greedy tokens the stack must give."""

import re

import httpx
import openai
import pytest

from jaxstream.config import load_config
from jaxstream.protocol import SamplingParams
from tests.support import assert_idle, serve_process
from tests.worker.driver import Driver
from worker_svc.start import build_engine

pytestmark = [pytest.mark.pipeline]

# Step shapes small enough to compile in seconds; the same for the stack and the reference engine.
SMALL = ["worker.token_buckets=[4,16]", "worker.pair_buckets=[0,16,64]", "scheduler.max_running_requests=4",
         "scheduler.max_tokens_per_step=16", "scheduler.num_pages=64", "model.max_model_len=256"]
PROMPT = [1, 9, 4, 7, 3, 12, 40, 2, 8]
NEW_TOKENS = 12


@pytest.mark.parametrize("model,parallelism,devices", [("qwen3_tiny", "tp2", 2), ("qwen3_moe_tiny", "tp2_ep2", 4)])
def test_a_sharded_model_serves_the_single_device_tokens(redis_url, model, parallelism, devices):
    overrides = [f"model={model}", f"parallelism={parallelism}", "moe=ep", *SMALL]
    for up, base_url in serve_process(redis_url, *overrides):
        name = load_config(overrides).model.name
        chat = openai.OpenAI(base_url=base_url + "/v1", api_key="none").chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
        assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1
        body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
                "return_logprob": True}
        served = httpx.post(base_url + "/generate", json=body, timeout=60).json()
        # A constrained row's token mask, applied by its own executable under the mesh
        regex = {"text": "Code:", "sampling_params": {"temperature": 0, "max_new_tokens": 12, "regex": "[a-z]{3}-[0-9]{2}"}}
        constrained = httpx.post(base_url + "/generate", json=regex, timeout=60).json()
        info = httpx.get(base_url + "/get_server_info", timeout=10).json()
        assert_idle(base_url)
        assert f"mesh {{'tensor': 2, 'expert': {devices // 2}}}" in up.log()  # the worker's start-up line
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", constrained["text"]) and constrained["meta_info"]["finish_reason"]["type"] == "stop", constrained
    served_tokens = [token_id for _, token_id, _ in served["meta_info"]["output_token_logprobs"]]
    assert info["tp_size"] == 2 and info["ep_size"] == devices // 2

    reference = build_engine(load_config([f"model={model}", "parallelism=single", "moe=ep", *SMALL]), progress=False)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    trace = Driver(reference, 16, 64, budget=16, max_running=4).run([("r", PROMPT, greedy)])
    assert served_tokens == trace["r"].tokens
