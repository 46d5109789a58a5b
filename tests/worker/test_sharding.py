"""Tensor and expert parallelism by logical rules (worker_svc/sharding.py, layers/moe.py): the same
tokens on 1, 2 and 4 (fake CPU) devices, `ep` exchanging tokens with all-to-all, ConfigErrors that
name the key, and golden PartitionSpecs per model and layout."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

from jaxstream.config import MESH_AXES, ConfigError, ParallelismConfig, load_config
from tests.worker.tp_check import LAYOUTS, MODELS, MOE_LAYOUTS
from worker_svc.models.llama import Llama, LlamaConfig
from worker_svc.sharding import Layout, make_layout, param_specs

GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(scope="module")
def runs(fake_device_runs) -> dict[tuple[str, str | None], dict]:
    """tp_check.py's results by (model, layout), from its run on fake devices (conftest.py)."""
    lines = [json.loads(line) for line in fake_device_runs.stdout("tp_check").splitlines() if line.startswith("{")]
    return {(r["model"], r["layout"]): r for r in lines}


SHARDED = [(model, layout) for model in sorted(MODELS) for layout in LAYOUTS.get(model, MOE_LAYOUTS) if layout != "single"]


@pytest.mark.parametrize("model,layout", SHARDED)
def test_a_parallel_layout_gives_the_single_device_tokens(runs, model, layout):
    single, run = runs[model, "single"], runs[model, layout]
    assert run["tokens"] == single["tokens"]
    # Measured ~3e-7 (llama), ~2.5e-6 (qwen3, qwen3_moe; ep vs fused 1.4e-6): partial sums in another order.
    assert run["max_diff"] < 1e-4, run["max_diff"]
    split = "'tensor'" if "tp" in layout else "None"
    assert run["cache_spec"] == f"P(None, None, None, {split}, None)"  # [L, P, S, K, H] split by kv head under tp
    assert run["aliases"] >= 2 and run["recompiles"] == 0  # the donated, sharded cache is still updated in place
    assert run["cache_copies"] == 0  # nor copied, where a shard holds one KV head (tp4) too


def test_a_model_of_several_layer_stacks_does_not_copy_its_cache(runs):
    """Every run, Qwen3-MoE's included: its MoE layer 0 and dense layer 1, two stacks of one layer each,
    run in one scan (layers/decoder.py), where a scan per stack was unrolled and copied the cache."""
    assert [key for key, run in runs.items() if run["cache_copies"]] == []


def test_moe_strategies_give_the_same_tokens(runs):
    assert runs["qwen3_moe_ep", "single"]["tokens"] == runs["qwen3_moe", "single"]["tokens"]


@pytest.mark.parametrize("model,layout", [(m, layout) for m in ("qwen3_moe", "qwen3_moe_ep") for layout in MOE_LAYOUTS])
def test_ep_exchanges_tokens_with_all_to_all_exactly_when_experts_are_split(runs, model, layout):
    exchanged = runs[model, layout]["all_to_all"] > 0
    assert exchanged == (model == "qwen3_moe_ep" and "ep2" in layout)  # fused: GSPMD's reductions instead


def test_a_one_device_mesh_is_bit_identical_to_no_mesh(runs):
    assert runs["llama", "single"]["tokens"] == runs["llama", None]["tokens"]
    assert runs["llama", "single"]["max_diff"] == 0.0


def test_a_device_count_unlike_the_sizes_product_fails_naming_parallelism():
    with pytest.raises(ConfigError, match=r"parallelism: tensor 2 x expert 1 = 2 devices per replica, but there are 1"):
        make_layout(load_config(["parallelism=tp2"]).parallelism, devices=[_Device()])


def test_a_process_seeing_every_replicas_devices_takes_its_own_share():
    devices = [_Device() for _ in range(4)]
    for replica in (0, 1):
        parallelism = load_config(["parallelism=tp2", "parallelism.data=2", f"parallelism.replica={replica}"]).parallelism
        assert list(make_layout(parallelism, devices).mesh.devices.flat) == devices[2 * replica:2 * replica + 2]


def test_the_worker_refuses_a_layout_before_loading_anything():
    from worker_svc.start import build_engine  # noqa: PLC0415

    jax.devices()  # JAX's backends are up with one CPU device, so the worker cannot ask for four
    cfg = load_config(["parallelism=tp4", "model.path=/nonexistent"])  # the checkpoint is never opened
    with pytest.raises(ConfigError, match=r"^parallelism: .* = 4 devices"):
        build_engine(cfg, progress=False)


@pytest.mark.parametrize("numbers,message", [
    (dict(vocab=98, heads=9, kv_heads=3), "parallelism.tensor: 2 does not divide model kv_heads 3"),
    (dict(vocab=101, heads=8, kv_heads=4), "parallelism.tensor: 2 does not divide model vocab 101"),
    (dict(vocab=128, heads=8, kv_heads=4, mlp_dim=33), "parallelism.tensor: 2 does not divide model mlp 33"),
])
def test_a_tensor_size_that_does_not_divide_the_model_fails_naming_both(numbers, message):
    cfg = LlamaConfig(**{**dict(dim=32, layers=2, head_dim=8, mlp_dim=64, rope_theta=1e4, norm_eps=1e-5, tie_embeddings=True), **numbers})
    with pytest.raises(ConfigError, match=message):
        param_specs(_abstract_params(Llama, cfg), _abstract_layout("tp2"))


def test_one_mesh_axis_sharding_two_axes_of_a_parameter_fails():
    rules = {**load_config(["parallelism=tp2"]).parallelism.rules, "head_dim": "tensor"}
    layout = Layout(AbstractMesh((2, 1), MESH_AXES), rules)
    with pytest.raises(ConfigError, match="parallelism.rules: .* a mesh axis may shard only one"):
        param_specs(_abstract_params(*MODELS["llama"]), layout)


def test_expert_parallelism_for_a_dense_model_fails_naming_the_axis():
    with pytest.raises(ConfigError, match=r"parallelism.expert: 2 devices, but this model has no parameter split over them"):
        param_specs(_abstract_params(*MODELS["qwen3"]), _abstract_layout("ep2"))


def test_an_expert_size_that_does_not_divide_the_experts_fails_naming_both():
    model_cls, cfg = MODELS["qwen3_moe"]
    rules = {**load_config(["parallelism=ep2"]).parallelism.rules}
    with pytest.raises(ConfigError, match="parallelism.expert: 3 does not divide model expert 8"):
        param_specs(_abstract_params(model_cls, cfg), Layout(AbstractMesh((1, 3), MESH_AXES), rules))


GOLDEN_CASES = [("llama", "single"), ("llama", "tp2"), ("qwen3", "single"), ("qwen3", "tp2")] + [
    ("qwen3_moe", layout) for layout in ("single", "tp2", "ep2", "tp2_ep2")]


@pytest.mark.parametrize("model,layout", GOLDEN_CASES)
def test_partition_specs_match_the_golden_file(model, layout):
    """To accept a change: JAXSTREAM_UPDATE_GOLDEN=1 pytest tests/worker/test_sharding.py, then review the diff."""
    got = "".join(f"{path} {spec}\n" for path, spec in param_specs(_abstract_params(*MODELS[model]), _abstract_layout(layout)))
    path = GOLDEN / f"{model}_{layout}.txt"
    if os.environ.get("JAXSTREAM_UPDATE_GOLDEN"):
        path.write_text(got)
    assert got == path.read_text(), f"{path.name} differs; see the docstring to update it"


class _Device:  # make_layout fails on the count before it builds a mesh of these
    platform = "cpu"


def _abstract_params(model_cls, cfg) -> nnx.State:
    return nnx.state(nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(0))))


def _abstract_layout(name: str) -> Layout:
    """The layout a config names, on a mesh of its sizes without devices (no fake devices needed)."""
    p: ParallelismConfig = load_config([f"parallelism={name}"]).parallelism
    return Layout(AbstractMesh(tuple(getattr(p, axis) for axis in MESH_AXES), MESH_AXES), p.rules)
