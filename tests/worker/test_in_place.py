"""worker.weights_in_place (layers/in_place.py): layer weights held one buffer per layer and read in
place. No compiled step writes a layer weight out (counted in the HLO), the model serves what the
stacked layout serves (float32; int8 in a MoE model with a dense stack beside its MoE one), and the
hot swap, release and resume keep the held tree and compile nothing."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxstream import protocol
from tests.worker.conftest import BUCKETS, NUM_PAGES, PAGE_SIZE, TINY
from tests.worker.driver import Driver
from tests.worker.hlo_check import weight_writes
from tests.worker.int8_check import built
from worker_svc.engine import Engine
from worker_svc.compiles import counter
from worker_svc.layers import product_kernel
from worker_svc.layers.in_place import Layers
from worker_svc.layers.numerics import Numerics
from worker_svc.models.llama import Llama
from worker_svc.models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig

GREEDY = protocol.SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
PROMPTS = {"a": np.random.default_rng(5).integers(0, TINY.vocab, 9).tolist()}  # steps of two shapes: few compiles

# Layer weights of shapes no activation of a BUCKETS step has: dims 3, 40, 96, 112 (the cache is [L, P, 4, 1, 40]).
ODD = dataclasses.replace(TINY, dim=96, heads=3, kv_heads=1, head_dim=40, mlp_dim=112, layers=3)
ODD_WEIGHTS = ((96, 3, 40), (96, 1, 40), (3, 40, 96), (96, 112), (112, 96))  # q, k and v, o, gate and up, down
NUMBERS = {k: getattr(TINY, k) for k in ("vocab", "dim", "layers", "heads", "kv_heads", "head_dim", "mlp_dim", "rope_theta", "norm_eps")}
# int8 (each held leaf two, values and scale) and two stacks (dense layers 0 and 2 around MoE layer 1,
# so the dense stack runs in two parts; the MoE layer's attention is held, its experts stay scanned),
# in one model: one pair of engines to compile.
MOE_INT8 = Qwen3MoeConfig(**{**NUMBERS, "layers": 3}, tie_embeddings=False, experts=4, top_k=2, moe_mlp_dim=16, moe_layers=(1,),
                          numerics=Numerics(quantization="int8"))


def engines(model_cls, cfg) -> tuple[Engine, Engine]:
    """(held in place, stacked) engines of the same weights (each its own tree of the same arrays)."""
    model = built(model_cls, cfg)
    graph, state = nnx.split(model)
    return tuple(Engine(nnx.merge(graph, jax.tree.map(lambda a: a, state)), BUCKETS, PAGE_SIZE, NUM_PAGES, weights_in_place=held)
                 for held in (True, False))


def served(engine: Engine) -> dict:
    return Driver(engine, PAGE_SIZE, NUM_PAGES, 16, 8, keep_logits=False).run([(rid, p, GREEDY) for rid, p in PROMPTS.items()])


def assert_same_service(a: Engine, b: Engine) -> None:
    """The same tokens, and logprobs to float rounding."""
    x, y = served(a), served(b)
    for rid in PROMPTS:
        assert x[rid].tokens == y[rid].tokens, rid
        np.testing.assert_allclose(x[rid].logprobs, y[rid].logprobs, rtol=0, atol=1e-5)


def weight_copies(hlo: str) -> list[str]:
    return weight_writes(hlo, ODD_WEIGHTS)


def test_no_step_writes_out_a_layer_weight_and_the_stacked_scan_does():
    held, stacked = engines(Llama, ODD)
    assert all(isinstance(var[...], Layers) for path, var in nnx.to_flat_state(held.params) if path[0] == "layers"
               and path[1] in ("attn", "mlp") and "norm" not in path[2])
    for shape in [(1, 0, BUCKETS.max_pages), (2, 0, BUCKETS.max_pages), (16, 64, 0)]:  # page-list decode steps and a pairs prefill step
        assert weight_copies(held.lower_forward(shape).compile().as_text()) == [], shape
        # The detector sees copies: the scan's slice of each weight at least, but no transpose of one
        # (o's weight, its two contracted axes merged into one by Numerics, is read in its own order).
        copies = weight_copies(stacked.lower_forward(shape).compile().as_text())
        assert len(copies) >= len(ODD_WEIGHTS), shape
        assert [line for line in copies if " transpose(" in line] == [], shape


@pytest.mark.skipif(bool(product_kernel.load()), reason="the product kernel cannot be built here")
def test_with_the_product_kernel_a_step_of_up_to_32_rows_reads_the_stacked_weights_in_place():
    """The layer scan hands the kernel each stacked weight whole with its layer row (decoder.py), so
    decode steps and a 16-token prefill write no layer weight out without holding them per layer
    (float32: up to 32 rows; the test above has the detector see the stacked scan's slices)."""
    engine = Engine(built(Llama, dataclasses.replace(ODD, numerics=Numerics(product_kernel=True))), BUCKETS, PAGE_SIZE, NUM_PAGES)
    for shape in [(1, 0, BUCKETS.max_pages), (2, 0, BUCKETS.max_pages), (16, 64, 0)]:
        assert weight_copies(engine.lower_forward(shape).compile().as_text()) == [], shape


def test_held_int8_weights_of_a_model_of_two_stacks_serve_what_stacked_ones_serve():
    held, stacked = engines(Qwen3Moe, MOE_INT8)
    flat = dict(nnx.to_flat_state(held.params))
    assert isinstance(flat[("dense_layers", "attn", "q", "values")][...], Layers)
    assert isinstance(flat[("moe_layers", "attn", "q", "scale")][...], Layers)
    assert not isinstance(flat[("moe_layers", "mlp", "experts", "gate", "values")][...], Layers)  # experts stay stacked
    assert_same_service(held, stacked)


def test_a_pushed_row_a_release_and_a_resume_keep_the_held_tree_and_compile_nothing():
    held, stacked = engines(Llama, TINY)
    assert_same_service(held, stacked)  # float32, and it compiles the shapes the rest of the test serves
    compiles = counter().count  # the process's count
    q = np.random.default_rng(0).standard_normal((32, 32)).astype(np.float32)  # layer 1's q_proj, [N*H, D]
    layer_0 = np.asarray(dict(nnx.to_flat_state(held.params))[("layers", "attn", "q")][...][0])
    for engine in (held, stacked):
        engine.stage_tensors([("model.layers.1.self_attn.q_proj.weight", q)])
        assert engine.commit_weights() == 1
    q_after = dict(nnx.to_flat_state(held.params))[("layers", "attn", "q")][...]
    assert isinstance(q_after, Layers)
    np.testing.assert_array_equal(np.asarray(q_after[0]), layer_0)  # layer 0 kept
    np.testing.assert_array_equal(np.asarray(q_after)[1], q.reshape(4, 8, 32).transpose(2, 0, 1))
    assert_same_service(held, stacked)
    held.release({"weights"})
    assert held.stage_dummy(0) > 0 and held.commit_weights() > 0  # back as worker.weights=dummy starts
    assert all(isinstance(var[...], Layers) for path, var in nnx.to_flat_state(held.params) if path[-1] == "q")
    resumed = served(held)
    stacked.stage_dummy(0)
    stacked.commit_weights()
    assert [t.tokens for t in resumed.values()] == [t.tokens for t in served(stacked).values()]
    assert counter().count == compiles
