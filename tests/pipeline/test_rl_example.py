"""examples/grpo end to end: `jaxstream up model=qwen3_moe_tiny` (random weights, path: null) and the
GRPO loop against it over HTTP: the trainer's weights pushed by Hugging Face name, rollouts through
/generate, a clipped-ratio update and a hot push per round. The reward must rise, every rollout must
report the version pushed before it, the trainer's logprobs of the rollout tokens must be the
served ones within LOGPROB_TOLERANCE, and nothing may compile after start-up. Then the same loop
with `--lora`, on the same server (one adapter slot): the base pushed once, only the adapter after.

    python -m pytest tests/pipeline/test_rl_example.py -s    # prints the per-round table
"""

import httpx
import numpy as np
import pytest

from examples.grpo import train
from examples.grpo.model import init_params, to_hf
from jaxstream import rl
from jaxstream.config import load_config
from tests.support import assert_idle, serve
from worker_svc.models.qwen3_moe import Qwen3MoeConfig

pytestmark = pytest.mark.pipeline

# 32 samples a round (4 prompts x 8) decode in one step of the 64-token bucket; a few shapes
# compile in seconds.
SMALL = ("model=qwen3_moe_tiny", "scheduler.max_running_requests=32", "scheduler.max_tokens_per_step=64",
         "worker.token_buckets=[32,64]", "worker.pair_buckets=[0,64]", "scheduler.num_pages=64", "model.max_model_len=64",
         "worker.batch_invariant=true", "worker.enable_return_routed_experts=true", "worker.lora.max_adapters=1",
         "worker.lora.max_rank=8")
ROUNDS = 4
# Under worker.batch_invariant the trainer's whole-sequence pass, running the served layer
# functions, gives the served logprobs to the bit.
LOGPROB_TOLERANCE = 0.0
# With an adapter too: under worker.batch_invariant the server adds each row's delta by
# layers/lora.py's gathered_delta in the mode's row tiles (branch lorawk), and so does the trainer.
LORA_LOGPROB_TOLERANCE = 0.0
# Rank 8, the slot's max_rank (a lower rank is zero-padded there, which adds exact zeros). Scale 4 and a
# larger step than the full-weight run's: B starts at zero, and the reward must rise within ROUNDS.
LORA = ("--lora", "8", "--lora-alpha", "32", "--lr", "0.05", "--steps", "8")


@pytest.fixture(scope="module")
def stack(redis_url):
    yield from serve(redis_url, *SMALL)


def test_the_trainer_names_every_served_tensor_in_its_shape(stack):
    cfg = Qwen3MoeConfig.from_hf(dict(load_config(["model=qwen3_moe_tiny"]).model.hf_config))
    ours = {name: (list(t.shape), str(t.dtype)) for name, t in to_hf(init_params(cfg, 0), cfg).items()}
    served = {w["name"]: (w["shape"], w["dtype"]) for w in rl.list_weights(stack)}
    assert ours == served


def test_the_server_reports_its_rl_switches(stack):
    info = httpx.get(stack + "/get_server_info", timeout=10).json()
    assert (info["batch_invariant"], info["enable_deterministic_inference"], info["enable_return_routed_experts"]) == (True, True, True)
    assert (info["enable_fp32_router"], info["enable_fp32_lm_head"]) == (False, False)


def test_grpo_raises_the_reward_on_fresh_weight_versions_and_stays_on_policy(stack, capsys):
    args = train.parse_args(["--url", stack, "--rounds", str(ROUNDS), "--max-logprob-diff", str(LOGPROB_TOLERANCE)])
    rows, replayed = train.run(args)
    table = capsys.readouterr().out
    with capsys.disabled():
        print(f"\n{table}routing {'replayed' if replayed else 'the trainer own'}")
    assert [row.weight_version for row in rows] == ["init", *(f"round-{r}" for r in range(ROUNDS))], table
    assert rl.weight_version(stack) == f"round-{ROUNDS - 1}"
    assert train.verdict(rows, LOGPROB_TOLERANCE) is None, table
    assert np.mean([row.reward for row in rows[-2:]]) > 2 * rows[0].reward, table
    assert [s["compiles_after_ready"] for s in httpx.get(stack + "/stats", timeout=10).json()["worker"].values()] == [0]
    assert_idle(stack)


def test_grpo_with_lora_pushes_only_the_adapter_and_raises_the_reward(stack, capsys):
    args = train.parse_args(["--url", stack, "--rounds", str(ROUNDS), "--max-logprob-diff", str(LORA_LOGPROB_TOLERANCE), *LORA])
    rows, _ = train.run(args)
    table = capsys.readouterr().out
    with capsys.disabled():
        print(f"\n{table}")
    assert [row.weight_version for row in rows] == ["init", *(f"round-{r}" for r in range(ROUNDS))], table
    assert train.verdict(rows, LORA_LOGPROB_TOLERANCE) is None, table
    adapters = [m for m in httpx.get(stack + "/v1/models", timeout=10).json()["data"] if m["id"] == args.lora_name]
    assert adapters and adapters[0]["parent"] is not None
    assert [s["compiles_after_ready"] for s in httpx.get(stack + "/stats", timeout=10).json()["worker"].values()] == [0]
    assert_idle(stack)
