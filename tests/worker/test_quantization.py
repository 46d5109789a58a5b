"""int8 weight-only quantization (worker.quantization=int8, layers/quantized.py): the representation's
error bound, its products against the dequantized weight, tiny models against their float32 selves
(Qwen3-MoE's experts under both strategies), a GGUF of Q8_0 blocks requantized per channel, hot swaps
that keep the int8 tree and compile nothing, and, on 2 fake CPU devices, tensor and expert parallelism
equal to one device (int8_check.py)."""

import json
from dataclasses import replace
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxstream.config import load_config
from tests.worker.conftest import BUCKETS, NUM_PAGES, PAGE_SIZE, TINY
from tests.worker.int8_check import built
from tests.worker.test_swap import MODELS, leaves, logits, write_checkpoint
from worker_svc.compiles import counter
from worker_svc.engine import Engine
from worker_svc.hf_index import hf_tensors
from worker_svc.layers import quantized
from worker_svc.layers.attention import PagedContext
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.quantized import QArray, dequantize, quantize
from worker_svc.loading import load_model
from worker_svc.models.llama import Llama
from worker_svc.start import numerics
from worker_svc.swap import WeightSwap
from worker_svc.weights import open_checkpoint

INT8 = Numerics(quantization="int8")


def test_quantize_is_within_half_a_scale_per_element_and_a_zero_channel_is_exact():
    w = np.random.default_rng(0).standard_normal((6, 40, 5)).astype(np.float32)
    w[:, :, 2] = 0.0  # an output channel of zeros
    values, scale = quantize(w, (1,))
    assert values.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (6, 1, 5)
    assert np.abs(values).max() == 127 and values.min() >= -127
    assert np.all(np.abs(values.astype(np.float32) * scale - w) <= scale / 2 * (1 + 1e-6))
    assert np.all(values[:, :, 2] == 0) and np.all(scale[:, :, 2] == 1.0)
    np.testing.assert_array_equal(quantize(-w, (1,))[0], -values)  # symmetric


@pytest.mark.parametrize("spec,shape,contracted,x_shape", [
    ("TD,DNH->TNH", (24, 4, 8), (0,), (3, 24)),  # scale after the product
    ("TNH,NHD->TD", (4, 8, 24), (0, 1), (3, 4, 8)),
    ("RD,VD->RV", (96, 24), (1,), (3, 24)),  # the tied head: a scale per vocabulary row
    ("TEF,EFD->TD", (4, 16, 24), (1,), (3, 4, 16)),  # fused experts' down: dequantized first
])
@pytest.mark.parametrize("chunk_bytes", [4 << 20, 1024], ids=["whole", "chunked"])  # chunks: an output or a contracted axis
def test_a_product_with_int8_weights_equals_the_product_with_the_dequantized_weight(monkeypatch, spec, shape, contracted,
                                                                                      x_shape, chunk_bytes):
    monkeypatch.setattr(quantized, "CONVERT_CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(1)
    q = QArray(*quantize(rng.standard_normal(shape).astype(np.float32), contracted))
    x = rng.standard_normal(x_shape).astype(np.float32)
    got = jax.jit(lambda x, q: quantized.einsum(spec, x, q))(x, q)
    want = np.einsum(spec, x.astype(np.float64), np.asarray(dequantize(q, np.float32), np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_an_int8_tree_holds_values_and_scales_named_for_sharding_and_reports_int8():
    model = nnx.eval_shape(lambda: Llama(replace(TINY, tie_embeddings=False, numerics=INT8), rngs=nnx.Rngs(0)))
    state = {path: (var.dtype, var.shape, var.out_sharding) for path, var in nnx.to_flat_state(nnx.state(model))}
    assert state[("layers", "attn", "o", "values")] == (jnp.int8, (2, 4, 8, 32), ("layers", "heads", "head_dim", "embed"))
    assert state[("layers", "attn", "o", "scale")] == (jnp.float32, (2, 1, 1, 32), ("layers", None, None, "embed"))
    assert state[("embed", "table", "scale")] == (jnp.float32, (101, 1), ("vocab", None))
    assert state[("lm_head", "w", "scale")] == (jnp.float32, (1, 101), (None, "vocab"))
    assert state[("layers", "attn_norm", "scale")][0] == jnp.float32  # norms stay in the model dtype
    names = WeightSwap(None).names(model)  # Engine.weight_names (shapes only: the abstract model will do)
    dtypes = {name: dtype for name, _, dtype in names}
    assert len(names) == 2 * 9 + 3 and dtypes["model.layers.0.self_attn.q_proj.weight"] == "int8"
    assert dtypes["model.embed_tokens.weight"] == "int8" and dtypes["model.norm.weight"] == "float32"
    assert ("model.layers.1.self_attn.q_proj.weight", (32, 32), "int8") in names  # Hugging Face shapes, as ever


def forward(model, tokens: np.ndarray) -> np.ndarray:
    """Logits [T, V] of one sequence in one pass, nothing cached."""
    cfg = model.cfg
    ctx = PagedContext.padded(len(tokens), 0)._replace(positions=np.arange(len(tokens), dtype=np.int32),
                                                        segment=np.zeros(len(tokens), np.int32))  # one row
    ctx = jax.tree.map(jnp.asarray, ctx)
    spec = model.cache_spec()  # one empty page of each array the model's cache has
    cache = spec.cache({name: jnp.zeros(shape) for name, shape in spec.shapes(cfg.layers, 1, 4).items()})
    return np.asarray(nnx.jit(lambda m, t: m(t, ctx, cache, jnp.arange(len(tokens)))[0])(model, jnp.asarray(tokens)))


def test_a_qwen3_moe_in_int8_gives_its_float32_logits_within_quantization_error_under_both_strategies():
    model_cls, cfg = MODELS["qwen3_moe"]
    tokens = np.random.default_rng(2).integers(0, cfg.vocab, 12)
    exact = forward(built(model_cls, cfg, seed=3), tokens)
    weights = nnx.state(built(model_cls, replace(cfg, numerics=INT8), seed=3))  # the same draw, quantized
    int8 = {}
    for strategy in ("fused", "ep"):  # the same tree either way
        graph = nnx.graphdef(nnx.eval_shape(lambda s=strategy: model_cls(replace(cfg, moe=s, numerics=INT8), rngs=nnx.Rngs(0))))
        int8[strategy] = forward(nnx.merge(graph, weights), tokens)
    # ep scales each expert's rows after its grouped products, fused dequantizes the down projection
    # first: the same numbers but for float rounding.
    assert np.abs(int8["ep"] - int8["fused"]).max() < 1e-5
    per_token = np.abs(int8["fused"] - exact).max(-1)
    # Measured, against logits of std 1.03: 0.03-0.09 a token, and 0.30 for one whose second expert
    # changed (the router is float32, but its input moved).
    assert np.median(per_token) < 0.1 * exact.std() and per_token.max() < 0.5 * exact.std(), per_token
    assert (int8["fused"].argmax(-1) == exact.argmax(-1)).mean() >= 0.9


def write_q8_gguf(path: Path) -> dict[str, np.ndarray]:
    """A 1-layer Qwen3 GGUF whose every matrix is Q8_0 (blocks of 32 with a float16 scale each);
    returns the matrices as the reader dequantizes them, by GGUF name."""
    V, D, N, K, H, F = 64, 64, 2, 1, 32, 96
    rng = np.random.default_rng(4)
    shapes = {"token_embd.weight": (V, D), "output_norm.weight": (D,), "blk.0.attn_norm.weight": (D,), "blk.0.ffn_norm.weight": (D,),
              "blk.0.attn_q_norm.weight": (H,), "blk.0.attn_k_norm.weight": (H,), "blk.0.attn_q.weight": (N * H, D),
              "blk.0.attn_k.weight": (K * H, D), "blk.0.attn_v.weight": (K * H, D), "blk.0.attn_output.weight": (D, N * H),
              "blk.0.ffn_gate.weight": (F, D), "blk.0.ffn_up.weight": (F, D), "blk.0.ffn_down.weight": (D, F)}
    writer = gguf.GGUFWriter(path, "qwen3")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 128), (writer.add_embedding_length, D),
                       (writer.add_feed_forward_length, F), (writer.add_head_count, N), (writer.add_head_count_kv, K),
                       (writer.add_key_length, H), (writer.add_value_length, H), (writer.add_layer_norm_rms_eps, 1e-6)):
        add(value)
    q8 = gguf.GGMLQuantizationType.Q8_0
    read = {}
    for name, shape in shapes.items():
        w = rng.normal(size=shape).astype(np.float32)
        if len(shape) == 2:
            blocks = gguf.quants.quantize(w, q8)
            writer.add_tensor(name, blocks, raw_dtype=q8)
            read[name] = gguf.quants.dequantize(blocks, q8).reshape(shape)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read


def test_a_q8_0_gguf_loads_requantized_per_channel_within_half_a_scale_of_its_blocks(tmp_path):
    blocks = write_q8_gguf(tmp_path / "q8.gguf")
    checkpoint = open_checkpoint(tmp_path / "q8.gguf")
    exact = nnx.to_flat_state(nnx.state(load_model(checkpoint, progress=False)))
    int8 = load_model(checkpoint, progress=False, numerics=INT8)
    state = dict(nnx.to_flat_state(nnx.state(int8)))
    for path, var in exact:
        if (*path, "values") not in state:  # norms: unchanged
            np.testing.assert_array_equal(state[path][...], var[...])
            continue
        q = QArray(np.asarray(state[(*path, "values")][...]), np.asarray(state[(*path, "scale")][...]))
        assert np.all(np.abs(dequantize(q, np.float32) - var[...]) <= q.scale / 2 * (1 + 1e-6)), path
    # the embedding row of token 5, dequantized: the checkpoint's own, within its row's half scale
    row = np.asarray(int8.embed(jnp.array([5])))[0]
    assert np.abs(row - blocks["token_embd.weight"][5]).max() <= np.asarray(int8.embed.table.scale[...])[5, 0] / 2 * (1 + 1e-6)


@pytest.fixture(scope="module")
def int8_engine():
    return Engine(built(Llama, replace(TINY, numerics=INT8)), BUCKETS, PAGE_SIZE, NUM_PAGES)


def test_disk_pushed_and_dummy_updates_keep_the_int8_tree_serve_the_new_weights_and_compile_nothing(int8_engine, tmp_path):
    engine = int8_engine
    before, original = logits(engine), engine.params  # compiles the shapes the request uses
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding), original)
    target = built(Llama, TINY, seed=1)  # float32
    fresh = Engine(load_model(open_checkpoint(write_checkpoint(tmp_path / "target", target)), progress=False, numerics=INT8),
                   BUCKETS, PAGE_SIZE, NUM_PAGES)
    compiles = counter().count
    try:
        assert engine.stage_tensors(hf_tensors(target)) == 20 and engine.commit_weights() == 11  # parameters, not leaves
        pushed = logits(engine)
        assert jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding), engine.params) == shapes
        assert engine.stage_disk(str(tmp_path / "target")) == 11 and engine.commit_weights() == 11
        from_disk = logits(engine)
        engine.stage_dummy(0)
        engine.commit_weights()
        assert jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding), engine.params) == shapes
        assert counter().count == compiles
    finally:
        engine.params = original
    np.testing.assert_array_equal(pushed, logits(fresh))  # quantized on the host, as load_model does
    np.testing.assert_array_equal(from_disk, pushed)
    assert not np.array_equal(pushed, before)


def test_a_pushed_row_is_quantized_alone_and_the_other_rows_keep_their_bytes(int8_engine):
    engine = int8_engine
    original = engine.params
    before = leaves(original)
    q = np.random.default_rng(0).standard_normal((32, 32)).astype(np.float32)  # [N*H, D]
    try:
        engine.stage_tensors([("model.layers.1.self_attn.q_proj.weight", q)])
        assert engine.commit_weights() == 1
        after = leaves(engine.params)
    finally:
        engine.params = original
    values, scale = (("layers", "attn", "q", leaf) for leaf in ("values", "scale"))
    for leaf in (values, scale):
        np.testing.assert_array_equal(after[leaf][0], before[leaf][0])  # layer 0 kept, bit for bit
    want = quantize(q.reshape(4, 8, 32).transpose(2, 0, 1), (0,))  # ours [D, N, H], a scale per (N, H)
    np.testing.assert_array_equal(after[values][1], want[0])
    np.testing.assert_array_equal(after[scale][1], want[1])
    assert all(after[path] is before[path] for path in before if path[:3] != ("layers", "attn", "q"))


def test_tensor_and_expert_parallel_int8_equal_one_device_and_a_sharded_swap_compiles_nothing(fake_device_runs):
    """tests/worker/int8_check.py, on 4 fake CPU devices (conftest.py runs it)."""
    lines = [json.loads(line) for line in fake_device_runs.stdout("int8_check").splitlines() if line.startswith("{")]
    runs = {(r["model"], r["layout"]): r for r in lines if "model" in r}
    for (model, layout), run in runs.items():
        if layout is None:
            continue
        assert run["tokens"] == runs[model.removesuffix("_ep"), None]["tokens"], (model, layout)
        assert run["max_diff"] < 1e-4 and run["recompiles"] == 0, (model, layout, run)
    assert runs["llama", "tp2"]["specs"] == {"values": "P(None, None, 'tensor')", "scale": "P(None, None, 'tensor')"}  # gate [L, D, F]
    # ep's experts split by expert, the down projection's scale [L, E, 1, D] too
    assert runs["qwen3_moe_ep", "ep2"]["specs"] == {"values": "P(None, 'expert', None, None)", "scale": "P(None, 'expert', None, None)"}
    assert next(r for r in lines if "swap" in r) == {"swap": "tp2", "kept": True, "same_params": True, "recompiles": 0}


def test_the_config_key_reaches_the_models_numerics():
    assert numerics(load_config(["worker.quantization=int8"])).quantization == "int8"
    assert numerics(load_config([])).quantization is None
