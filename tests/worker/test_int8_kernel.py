"""The int8 kernel (worker.int8_kernel, layers/int8_kernel.py): built with this machine's compiler, its
products against XLA's for every spec the layers hand it, each output row a function of its own row
alone (bit for bit, whatever the other rows and however the threads ran), the products it leaves to
XLA, tiny int8 models served with it against the same without it, the config turning it on only
where it applies, and a failed build reported, not raised."""

import logging
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstream.config import load_config
from tests.worker.conftest import BUCKETS, NUM_PAGES, PAGE_SIZE, TINY
from tests.worker.int8_check import built
from tests.worker.test_swap import MODELS, logits
from worker_svc import start
from worker_svc.engine import Engine
from worker_svc.layers import attention_kernel, int8_kernel, quantized
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.quantized import QArray, quantize
from worker_svc.models.llama import Llama

MISSING = int8_kernel.load()  # "" once built and registered (cached in ~/.cache/jaxstream/kernels)
needs_kernel = pytest.mark.skipif(bool(MISSING), reason=f"the int8 kernel cannot be built here: {MISSING}")

SPECS = [  # (spec, weight shape, contracted axes): what the layers hand Numerics.matmul
    ("TD,DF->TF", (37, 53), (0,)),  # gate/up/down; sizes off every vector width and part count
    ("TD,DNH->TNH", (24, 4, 8), (0,)),  # q, k, v: a scale per (head, dim)
    ("TNH,NHD->TD", (3, 8, 21), (0, 1)),  # o: Numerics merges its two contracted axes for the kernel
    ("RD,VD->RV", (70, 37), (1,)),  # a tied LM head: the table [V, D]
    ("TD,DF->TF", (576, 1536), (0,)),  # SmolLM2's sizes: every part, on the pool's threads
    ("RD,VD->RV", (2051, 576), (1,)),
]


def product(spec, x, q):
    return jax.jit(lambda x, v, s: int8_kernel.product(spec, x, v, s))(x, q.values, q.scale)


@needs_kernel
@pytest.mark.parametrize("spec,shape,contracted", SPECS)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_kernel_gives_xlas_int8_product_within_float32_rounding(spec, shape, contracted, rows):
    rng = np.random.default_rng(rows)
    q = QArray(*quantize(rng.standard_normal(shape).astype(np.float32), contracted))
    x = rng.standard_normal((rows, *(shape[a] for a in contracted))).astype(np.float32)
    served = jax.jit(lambda x, q: Numerics(quantization="int8", int8_kernel=True).matmul(spec, x, q))
    assert f"@{int8_kernel.TARGET}(" in served.lower(x, q).as_text()  # the kernel's product, not XLA's
    got = served(x, q)
    want = jax.jit(lambda x, q: quantized.einsum(spec, x, q))(x, q)
    assert got.shape == want.shape and got.dtype == jnp.float32
    exact = np.einsum(spec, x.astype(np.float64), np.asarray(q.values, np.float64) * np.asarray(q.scale, np.float64))
    scale = np.abs(exact).max()
    assert np.abs(np.asarray(got) - exact).max() <= 2e-6 * scale * np.sqrt(x[0].size)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)


@needs_kernel
@pytest.mark.parametrize("spec,shape,contracted", [s for s in SPECS if s[0] in ("TD,DF->TF", "RD,VD->RV")])
def test_each_row_is_a_function_of_its_own_row_alone_bit_for_bit(spec, shape, contracted):
    rng = np.random.default_rng(2)
    q = QArray(*quantize(rng.standard_normal(shape).astype(np.float32), contracted))
    x = rng.standard_normal((8, *(shape[a] for a in contracted))).astype(np.float32)
    together = np.asarray(product(spec, x, q))
    for row in range(8):
        np.testing.assert_array_equal(np.asarray(product(spec, x[row:row + 1], q))[0], together[row])
    others = x.copy()
    others[1:] = rng.standard_normal(others[1:].shape)
    np.testing.assert_array_equal(np.asarray(product(spec, others[:5], q))[0], together[0])
    for _ in range(5):  # the threads take the parts in another order each time; the sums stay put
        np.testing.assert_array_equal(np.asarray(product(spec, x, q)), together)


@needs_kernel
def test_what_the_kernel_does_not_take_is_left_to_xla():
    rng = np.random.default_rng(3)
    q = QArray(*quantize(rng.standard_normal((16, 24)).astype(np.float32), (0,)))
    x = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
    assert int8_kernel.product("TD,DF->TF", x, q.values, q.scale) is not None
    assert int8_kernel.product("TD,DF->TF", jnp.concatenate([x, x[:1]]), q.values, q.scale) is None  # 9 rows
    assert int8_kernel.product("TD,DF->TF", x.astype(jnp.bfloat16), q.values, q.scale) is None
    assert int8_kernel.product("TD,DF->TF", x, q.values, q.scale, preferred_element_type=jnp.bfloat16) is None
    assert int8_kernel.product("TD,DF->TF", x, q.values, q.scale, preferred_element_type=jnp.float32) is not None
    assert int8_kernel.product("TD,DF->TF", x, q.values.astype(jnp.float32), q.scale) is None  # float weights
    assert int8_kernel.product("TD,DF->FT", x, q.values, q.scale) is None  # rows not leading the output
    o = QArray(*quantize(rng.standard_normal((2, 8, 24)).astype(np.float32), (0, 1)))
    assert int8_kernel.product("TNH,NHD->TD", x.reshape(8, 2, 8), o.values, o.scale) is None  # Numerics merges N, H first
    experts = QArray(*quantize(rng.standard_normal((4, 16, 24)).astype(np.float32), (1,)))
    assert int8_kernel.product("TEF,EFD->TD", x.reshape(8, 1, 16).repeat(4, 1), experts.values, experts.scale) is None
    per_tensor = QArray(q.values, jnp.ones((1, 1), jnp.float32))  # not a scale per output channel
    assert int8_kernel.product("TD,DF->TF", x, per_tensor.values, per_tensor.scale) is None


@needs_kernel
@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])  # a tied head; an untied one, QK-norm and experts
def test_a_tiny_int8_model_serves_with_the_kernel_as_without_it(name):
    model_cls, cfg = (Llama, TINY) if name == "llama" else MODELS[name]
    without, with_kernel = (Engine(built(model_cls, replace(cfg, numerics=Numerics(quantization="int8", int8_kernel=k))),
                                   BUCKETS, PAGE_SIZE, NUM_PAGES) for k in (False, True))
    shapes = with_kernel.buckets.shapes()
    one, many = next(s for s in shapes if s[0] == 1), next(s for s in shapes if s[0] > int8_kernel.MAX_ROWS)

    def calls(engine, shape):
        return engine.lower_forward(shape).as_text().count(f"@{int8_kernel.TARGET}(")
    # A layer's 7 projections (one scan body; Qwen3-MoE's expert layers add a body of their 4
    # attention projections, the experts staying XLA's) and the head; a large step's layers are
    # XLA's, its head (on the step's sampled rows, at most 8 here) the kernel's.
    projections = 7 + 4 * (name == "qwen3_moe") + 1
    assert (calls(with_kernel, one), calls(with_kernel, many), calls(without, one)) == (projections, 1, 0)
    a, b = logits(without), logits(with_kernel)  # a prefill and decode steps, all of at most 8 tokens
    assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-4)
    if name == "llama":  # weights held in place (in_place.py): each switch branch's product by the kernel
        held = Engine(built(model_cls, replace(cfg, numerics=Numerics(quantization="int8", int8_kernel=True))),
                      BUCKETS, PAGE_SIZE, NUM_PAGES, weights_in_place=True)
        assert calls(held, one) == 7 * cfg.layers + 1  # a branch per layer
        np.testing.assert_allclose(logits(held), b, rtol=0, atol=1e-6)


def test_the_engine_turns_the_kernel_on_only_where_it_applies(monkeypatch, caplog):
    monkeypatch.setattr(int8_kernel, "load", lambda: "")
    on = ["worker.quantization=int8"]
    assert start.numerics(load_config(on)).int8_kernel
    assert not start.numerics(load_config(on), devices=2).int8_kernel  # a mesh: GSPMD would gather the weights
    assert not start.numerics(load_config([*on, "worker.batch_invariant=true"])).int8_kernel
    assert not start.numerics(load_config([*on, "worker.int8_kernel=false"])).int8_kernel
    assert not start.numerics(load_config([])).int8_kernel  # float weights
    monkeypatch.setattr(int8_kernel, "load", lambda: "no C++ compiler (c++, g++, clang++ or $CXX) on PATH")
    with caplog.at_level(logging.WARNING, logger="worker_svc.start"):
        assert not start.numerics(load_config(on)).int8_kernel
    assert "int8 products run in XLA" in caplog.text and "no C++ compiler" in caplog.text


@pytest.mark.parametrize("kernel", [int8_kernel, attention_kernel])  # cpu_kernel.py builds both
def test_a_build_that_fails_says_why_in_one_line(monkeypatch, tmp_path, kernel):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails whatever it is given
    with pytest.raises(RuntimeError, match=rf"^false could not build {kernel.KERNEL.source.name}: "):
        kernel.KERNEL.build(tmp_path)
    assert not list(tmp_path.glob("*.so"))
