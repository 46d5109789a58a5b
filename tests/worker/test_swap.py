"""Hot weight updates on tiny random models (worker_svc/swap.py): tensors pushed by Hugging Face name
or a checkpoint read from disk, staged, then committed; the engine then serves exactly what an
engine built with those weights serves, and nothing compiles. A bad update fails whole, naming
what is wrong, and the live weights keep serving.

A test that commits on the session `engine` puts its params back (finally), for the tests after it."""

import json
from dataclasses import replace
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxstream import protocol
from tests.worker.conftest import BUCKETS, NUM_PAGES, PAGE_SIZE, TINY
from tests.worker.driver import Driver
from tests.worker.invariant_check import FAMILIES
from worker_svc.compiles import counter
from worker_svc.engine import Engine
from worker_svc.hf_index import hf_tensors
from worker_svc.models.llama import Llama
from worker_svc.models.qwen3 import Qwen3, Qwen3Config
from worker_svc.models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig
from worker_svc.weights import CheckpointError

GREEDY = protocol.SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
PROMPT = np.random.default_rng(3).integers(0, TINY.vocab, 11).tolist()
NUMBERS = {k: getattr(TINY, k) for k in ("vocab", "dim", "layers", "heads", "kv_heads", "head_dim", "mlp_dim", "rope_theta", "norm_eps")}
MODELS = {  # every mapping and transform: untied LM head, QK-norm, experts in one stack beside a dense one
    "llama_untied": (Llama, replace(TINY, tie_embeddings=False)),
    "qwen3": (Qwen3, Qwen3Config(**NUMBERS, tie_embeddings=True)),
    "qwen3_moe": (Qwen3Moe, Qwen3MoeConfig(**NUMBERS, tie_embeddings=False, experts=4, top_k=2, moe_mlp_dim=16, moe_layers=(1,))),
    # The families since: biases (Qwen2, GPT-OSS), Mixtral's experts, Gemma's four norms and QK-norm, GPT-OSS's
    # sinks and its experts' interleaved gate and up (tp_check.py's and invariant_check.py's tiny models).
    # DeepSeek's latent attention (low-rank q, kv_b's two halves) and its MoE's router bias and shared expert.
    **{name: FAMILIES[name] for name in ("qwen2", "mistral", "mixtral", "gemma2", "gemma3", "gpt_oss", "deepseek")},
}


def logits(engine: Engine) -> np.ndarray:
    """The raw logits [3, V] of a short greedy request (a prefill and two decode steps)."""
    return np.stack(Driver(engine, PAGE_SIZE, NUM_PAGES, 16, 8, keep_logits=True).run([("x", PROMPT, GREEDY)])["x"].logits)


def leaves(params: nnx.State) -> dict:
    return {path: var[...] for path, var in nnx.to_flat_state(params)}


def engine_of(model: nnx.Module) -> Engine:
    return Engine(model, BUCKETS, PAGE_SIZE, NUM_PAGES)


def test_pushed_weights_serve_what_an_engine_built_with_them_serves_without_compiling(engine):
    before, original = logits(engine), engine.params
    target = Llama(TINY, rngs=nnx.Rngs(1))
    tensors = list(hf_tensors(target))
    compiles, after_ready = counter().count, engine.compiles_after_ready  # the count is the process's: other tests compile
    try:
        assert engine.stage_tensors(tensors[:7]) + engine.stage_tensors(iter(tensors[7:])) == len(tensors) == 20  # two buckets
        assert engine.commit_weights() == 11  # every parameter
        after = logits(engine)
        assert counter().count == compiles and engine.compiles_after_ready == after_ready
        for path, new in leaves(engine.params).items():  # the tree the executables were compiled for
            old = leaves(original)[path]
            assert (new.shape, new.dtype, new.sharding) == (old.shape, old.dtype, old.sharding), path
    finally:
        engine.params = original
    assert not np.array_equal(after, before)
    np.testing.assert_array_equal(after, logits(engine_of(target)))
    np.testing.assert_array_equal(logits(engine), before)  # put back for the next tests


@pytest.mark.parametrize("model", MODELS)
def test_every_tensor_name_reaches_its_row_of_its_parameter(model):
    """Each architecture's names and layouts, both ways: a model's tensors pushed into an engine of
    another seed make its parameters bit-identical to the model's."""
    model_cls, cfg = MODELS[model]
    source = model_cls(cfg, rngs=nnx.Rngs(1))
    engine = engine_of(model_cls(cfg, rngs=nnx.Rngs(0)))
    engine.stage_tensors(hf_tensors(source))
    engine.commit_weights()
    want = leaves(nnx.state(source))
    for path, value in leaves(engine.params).items():
        np.testing.assert_array_equal(value, want[path], err_msg=str(path))


def test_a_partial_update_changes_only_the_rows_pushed_in_any_bucket_the_last_push_winning():
    engine = engine_of(Llama(TINY, rngs=nnx.Rngs(0)))
    before = leaves(engine.params)
    q = np.random.default_rng(0).standard_normal((32, 32)).astype(np.float16)  # [N*H, D]
    table = np.random.default_rng(1).standard_normal((TINY.vocab, TINY.dim))
    engine.stage_tensors([("model.layers.1.self_attn.q_proj.weight", q), ("model.embed_tokens.weight", table)])
    engine.stage_tensors([("model.embed_tokens.weight", table.astype(ml_dtypes.bfloat16))])  # the same parameter again
    assert engine.commit_weights() == 2
    after = leaves(engine.params)
    assert after[("layers", "attn", "q")].dtype == np.float32
    np.testing.assert_array_equal(after[("layers", "attn", "q")][0], before[("layers", "attn", "q")][0])  # layer 0 kept
    np.testing.assert_array_equal(after[("layers", "attn", "q")][1], q.astype(np.float32).reshape(4, 8, 32).transpose(2, 0, 1))
    np.testing.assert_array_equal(after[("embed", "table")], table.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert all(after[path] is before[path] for path in before if path not in {("layers", "attn", "q"), ("embed", "table")})


@pytest.mark.parametrize("bad,message", [
    (("model.layers.0.self_attn.q_proj.weights", np.zeros((32, 32), np.float32)),
     "no tensor 'model.layers.0.self_attn.q_proj.weights' in the serving model; close names: ['model.layers.0.self_attn.q_proj.weight'"),
    (("model.layers.1.self_attn.k_proj.weight", np.zeros((32, 16), np.float32)),
     "model.layers.1.self_attn.k_proj.weight: shape (32, 16), but the model expects (16, 32) (Hugging Face layout)"),
    (("model.norm.weight", np.ones(32, np.int32)), "model.norm.weight: dtype int32 is not a float"),
])
def test_a_bad_tensor_fails_naming_it_and_the_whole_update_is_dropped(engine, bad, message):
    before = logits(engine)
    try:
        engine.stage_tensors([("model.norm.weight", np.full(32, 2.0, np.float32))])  # an earlier, good bucket
        with pytest.raises(CheckpointError) as failed:
            engine.stage_tensors([("model.layers.0.mlp.up_proj.weight", np.zeros((48, 32), np.float32)), bad])
        assert message in str(failed.value)
        with pytest.raises(CheckpointError, match="no weights are staged"):
            engine.commit_weights()
    finally:
        engine.discard_weights()
    np.testing.assert_array_equal(logits(engine), before)


def test_weight_names_are_what_the_model_reads_in_hugging_face_shapes():
    tied = engine_of(Llama(TINY, rngs=nnx.Rngs(0))).weight_names()
    assert len(tied) == 2 * 9 + 2 and not any(name.startswith("lm_head") for name, _, _ in tied)
    shapes = {name: shape for name, shape, _ in tied}
    assert shapes["model.embed_tokens.weight"] == (101, 32)
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (32, 32)  # [N*H, D]
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (16, 32)  # [K*H, D]
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (32, 32)  # [D, N*H]
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (32, 48)  # [D, F]
    assert shapes["model.norm.weight"] == (32,)
    assert {dtype for _, _, dtype in tied} == {"float32"}
    untied = engine_of(Llama(replace(TINY, tie_embeddings=False), dtype=jax.numpy.bfloat16, rngs=nnx.Rngs(0))).weight_names()
    assert ("lm_head.weight", (101, 32), "bfloat16") in untied
    moe = engine_of(MODELS["qwen3_moe"][0](MODELS["qwen3_moe"][1], rngs=nnx.Rngs(0))).weight_names()
    assert ("model.layers.1.mlp.experts.3.down_proj.weight", (32, 16), "float32") in moe
    assert ("model.layers.0.mlp.down_proj.weight", (32, 48), "float32") in moe  # layer 0 is dense


def write_checkpoint(directory: Path, model: nnx.Module, **config) -> Path:
    """`model` as a Hugging Face directory: config.json and one model.safetensors."""
    cfg = model.cfg
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab, "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.mlp_dim, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings, **config}))
    save_file(dict(hf_tensors(model)), str(directory / "model.safetensors"))
    return directory


def test_a_checkpoint_from_disk_is_staged_whole(tmp_path):
    source = Llama(TINY, rngs=nnx.Rngs(1))
    path = write_checkpoint(tmp_path / "next", source)
    engine = engine_of(Llama(TINY, rngs=nnx.Rngs(0)))
    assert engine.stage_disk(str(path), "safetensors") == 11
    assert engine.commit_weights() == 11
    want = leaves(nnx.state(source))
    for key, value in leaves(engine.params).items():
        np.testing.assert_array_equal(value, want[key], err_msg=str(key))


@pytest.mark.parametrize("config,load_format,message", [
    ({}, "gguf", "load_format 'gguf' needs a .gguf file"),
    ({}, "pt", "load_format 'pt' is not one of ['auto', 'safetensors', 'gguf']"),
    ({"num_hidden_layers": 3}, None, "not the serving model's config: layers 3 (serving 2)"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "auto", "holds a Qwen3 model; the serving one is a Llama"),
])
def test_a_checkpoint_of_another_model_or_format_is_refused_and_nothing_stays_staged(tmp_path, config, load_format, message):
    path = write_checkpoint(tmp_path / "other", Llama(TINY, rngs=nnx.Rngs(1)), **config)
    engine = engine_of(Llama(TINY, rngs=nnx.Rngs(0)))
    engine.stage_tensors([("model.norm.weight", np.ones(32, np.float32))])
    with pytest.raises(CheckpointError) as failed:
        engine.stage_disk(str(path), load_format)
    assert message in str(failed.value)
    assert not engine.swap.staged


def test_a_checkpoint_missing_a_tensor_fails_naming_it(tmp_path):
    path = write_checkpoint(tmp_path / "partial", Llama(TINY, rngs=nnx.Rngs(1)))
    tensors = dict(hf_tensors(Llama(TINY, rngs=nnx.Rngs(1))))
    del tensors["model.layers.1.mlp.gate_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    engine = engine_of(Llama(TINY, rngs=nnx.Rngs(0)))
    with pytest.raises(CheckpointError, match="no tensor 'model.layers.1.mlp.gate_proj.weight'"):
        engine.stage_disk(str(path))
    assert not engine.swap.staged


def test_a_sharded_engine_swaps_into_the_same_shardings_and_serves_a_fresh_engines_logits(fake_device_runs):
    """tests/worker/swap_check.py, on 4 fake CPU devices (conftest.py runs it)."""
    assert json.loads(fake_device_runs.stdout("swap_check").splitlines()[-1]) == {"same_shardings": True, "same_logits": True, "changed": True, "recompiles": 0}


def test_released_memory_comes_back_with_the_same_shapes_and_serves_without_compiling(tmp_path):
    """Release both tags, then resume: the KV cache empty, the weights from a checkpoint (or the
    dummy seed), every buffer with its old shape, dtype and sharding; nothing compiles."""
    model = Llama(TINY, rngs=nnx.Rngs(5))
    engine = engine_of(model)
    engine.executables.compile_all(progress=False)
    checkpoint = write_checkpoint(tmp_path / "checkpoint", model)
    before, shapes = logits(engine), jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding), (engine.params, engine.cache))
    compiles = counter().count
    engine.release({"weights", "kv_cache"})
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves((engine.params, engine.cache)))
    with pytest.raises(RuntimeError, match="released"):
        engine.step(None)
    engine.resume_kv_cache()
    engine.stage_disk(str(checkpoint))
    engine.commit_weights()
    assert not engine.released
    assert jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding), (engine.params, engine.cache)) == shapes
    np.testing.assert_array_equal(logits(engine), before)
    engine.release({"weights"})
    engine.stage_dummy(0)
    engine.commit_weights()
    assert counter().count == compiles
    assert not np.array_equal(logits(engine), before)  # seed 0's random weights, not model's


def test_released_weights_take_a_push_of_every_tensor_row_by_row_without_reading_the_freed_buffers():
    """After a release, pushed rows are staged onto zeros, never onto the freed buffers: a push of
    every tensor (each layer's row of a stacked parameter apart, in two buckets) serves what an
    engine built with them serves (worker_svc/control.py refuses a push that would leave one unset)."""
    engine = engine_of(Llama(TINY, rngs=nnx.Rngs(5)))
    engine.release({"weights"})
    target = Llama(TINY, rngs=nnx.Rngs(1))
    tensors = list(hf_tensors(target))
    assert engine.stage_tensors(tensors[:7]) + engine.stage_tensors(tensors[7:]) == len(tensors)
    assert engine.commit_weights() == 11 and not engine.released
    np.testing.assert_array_equal(logits(engine), logits(engine_of(target)))
