"""Every model x parallelism x moe config file composed, and the model's parameters laid out on a mesh
of the parallelism's sizes (no devices: an AbstractMesh), as the worker lays them out at start: each
combination validates, or fails with the message a user would get from the worker.

The models are built abstractly (shapes only) from their numbers: the released ones at full size.
"""

from __future__ import annotations

import functools

import pytest
from flax import nnx
from jax.sharding import AbstractMesh

from omegaconf import OmegaConf

from jaxstream.architectures import SERVED
from jaxstream.config import CONFIG_DIR, MESH_AXES, PATH_REQUIRED, ConfigError, group_options, load_config
from worker_svc.loading import model_config, open_model
from worker_svc.sharding import Layout, param_specs


def served(model: str) -> bool:
    """Whether the worker serves the model file's architecture: a file may come before its model
    does (configs/model/deepseek_*.yaml before worker_svc/models has DeepSeek), composed by
    tests/unit/test_config.py alone until then."""
    hf_config = OmegaConf.load(CONFIG_DIR / "model" / f"{model}.yaml").get("hf_config") or {}
    return not hf_config or any(name in SERVED for name in hf_config.get("architectures", []))


LAYOUTS, STRATEGIES = group_options("parallelism"), group_options("moe")
MODELS = [model for model in group_options("model") if served(model)]
MOE_MODELS = {"qwen3_moe_tiny", "qwen3_30b_a3b", "mixtral_tiny", "mixtral_8x7b_instruct", "gpt_oss_tiny", "gpt_oss_20b",
              "deepseek_v3_tiny", "deepseek_v2_lite", "moonlight_16b_a3b", "qwen3_5_35b_a3b", "qwen3_next_80b_a3b_instruct"}
NO_EXPERTS = r"parallelism.expert: 2 devices, but this model has no parameter split over them"


def expected_failure(model: str, layout: str) -> str | None:
    """The message (a regex) the combination fails with, or None where it must validate."""
    if model == "smollm2" and "tp" in layout:  # 9 heads, 3 kv heads
        return r"parallelism.tensor: \d does not divide model (kv_)?heads (9|3)"
    if model in ("qwen3_tiny", "qwen3_moe_tiny", "qwen3_5_tiny", "qwen3_5_35b_a3b", "qwen3_next_80b_a3b_instruct") and layout == "tp4":  # 2 kv heads
        return r"parallelism.tensor: 4 does not divide model kv_heads 2"
    if model not in MOE_MODELS and "ep" in layout:
        return NO_EXPERTS
    return None


@functools.cache
def abstract_model(model: str, moe: str):
    """(the model's parameters, shapes only; its config class instance) as the worker builds it."""
    cfg = load_config(overrides(model, "single", moe))
    checkpoint = open_model(cfg.model, dummy=True)  # numbers only where the file gives them (hf_config)
    model_cls, model_cfg, _ = model_config(checkpoint, moe)
    return nnx.state(nnx.eval_shape(lambda: model_cls(model_cfg, rngs=nnx.Rngs(0)))), model_cfg


def overrides(model: str, layout: str, moe: str) -> list[str]:
    """The files' names, and a path where the model file asks the user for one (`path: <required>`)."""
    required = OmegaConf.load(CONFIG_DIR / "model" / f"{model}.yaml").get("path") == PATH_REQUIRED
    return [f"model={model}", f"parallelism={layout}", f"moe={moe}"] + (["model.path=/models/x"] if required else [])


# A dense model has no experts for a strategy to place: its moe file changes nothing of its layout,
# so it is composed with the default one alone (the MoE models with each).
MODEL_STRATEGIES = [(model, moe) for model in MODELS for moe in (STRATEGIES if model in MOE_MODELS else ["fused"])]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model,moe", MODEL_STRATEGIES)
def test_a_combination_validates_or_fails_naming_both_numbers(model, layout, moe):
    parallelism = load_config(overrides(model, layout, moe)).parallelism
    mesh = Layout(AbstractMesh(tuple(getattr(parallelism, axis) for axis in MESH_AXES), MESH_AXES), parallelism.rules)
    params, model_cfg = abstract_model(model, moe)
    failure = expected_failure(model, layout)
    if failure is None:
        param_specs(params, mesh)
        if getattr(model_cfg, "moe", None) == "ep":
            assert mesh.expert_shards().groups == parallelism.expert
    else:
        with pytest.raises(ConfigError, match=failure):
            param_specs(params, mesh)


def test_every_model_parallelism_and_moe_file_is_covered():
    assert {"smollm2", "qwen3_tiny", "qwen3_moe_tiny", "qwen3_0_6b", "qwen3_8b", "qwen3_32b", "qwen3_30b_a3b",
            "llama3_1_8b", "qwen2_tiny", "qwen2_5_7b_instruct", "mistral_tiny", "mistral_7b_instruct_v0_3", "mixtral_tiny",
            "mixtral_8x7b_instruct"} <= set(MODELS)
    assert {"single", "tp2", "tp4", "dp2", "ep2", "tp2_ep2"} <= set(LAYOUTS) and set(STRATEGIES) == {"fused", "ep"}
