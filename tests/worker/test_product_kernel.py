"""The product kernel (worker.product_kernel, cpu_kernels/product_kernel.py): built with this machine's
compiler, its products of int8 and float32 weights against XLA's for every spec the layers hand it,
a layer of a stack read where it lies as its sliced weight is, each output row a function of its own
row alone (bit for bit, whatever the other rows and however the threads ran), the products it leaves
to XLA, tiny models served with it against the same without it, the config turning it on only where
it applies, and a failed build reported, not raised."""

import logging
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstream.config import load_config
from tests.worker.conftest import BUCKETS, NUM_PAGES, PAGE_SIZE, TINY
from tests.worker.hlo_check import weight_writes
from tests.worker.int8_check import built
from tests.worker.test_swap import MODELS, logits
from worker_svc import start
from worker_svc.cpu_kernels import attention_kernel, product_kernel
from worker_svc.cpu_kernels.kernels import CpuKernels
from worker_svc.engine import Engine
from worker_svc.layers import quantized
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.stack_layer import StackLayer
from worker_svc.layers.quantized import QArray, quantize
from worker_svc.models.llama import Llama

MISSING = product_kernel.load()  # "" once built and registered (cached in ~/.cache/jaxstream/kernels)
needs_kernel = pytest.mark.skipif(bool(MISSING), reason=f"the product kernel cannot be built here: {MISSING}")

SPECS = [  # (spec, weight shape, contracted axes): what the layers hand Numerics.matmul
    ("TD,DF->TF", (37, 53), (0,)),  # gate/up/down; sizes off every vector width and part count
    ("TD,DNH->TNH", (24, 4, 8), (0,)),  # q, k, v: an int8 scale per (head, dim)
    ("TNH,NHD->TD", (3, 8, 21), (0, 1)),  # o: Numerics merges its two contracted axes for the kernel
    ("RD,VD->RV", (70, 37), (1,)),  # a tied LM head: the table [V, D]
    ("TD,DF->TF", (576, 1536), (0,)),  # SmolLM2's sizes: every part, on the pool's threads
    ("RD,VD->RV", (2051, 576), (1,)),
]
KINDS = ["int8", "float32"]
PRODUCTS = CpuKernels(products=True)  # the product kernel alone, as start-up injects it


def products(numerics: Numerics) -> bool:
    """Whether the model's Numerics take weight products by the product kernel."""
    return numerics.kernels is not None and numerics.kernels.products


def weight(kind, w, contracted):
    """w (numpy float32) as the layers hold it: int8 values and scales (a QArray), or float32."""
    return QArray(*quantize(w, contracted)) if kind == "int8" else jnp.asarray(w)


def target(kind):
    return product_kernel.INT8 if kind == "int8" else product_kernel.FLOAT32


def exact(spec, x, w):
    """The product in float64."""
    w = np.asarray(w.values, np.float64) * np.asarray(w.scale, np.float64) if isinstance(w, QArray) else np.asarray(w, np.float64)
    return np.einsum(spec, np.asarray(x, np.float64), w)


def product(spec, x, w):
    return jax.jit(lambda x, w: product_kernel.product(spec, x, w))(x, w)


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec,shape,contracted", SPECS)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_kernel_gives_xlas_product_within_float32_rounding(kind, spec, shape, contracted, rows):
    rng = np.random.default_rng(rows)
    w = weight(kind, rng.standard_normal(shape).astype(np.float32), contracted)
    x = rng.standard_normal((rows, *(shape[a] for a in contracted))).astype(np.float32)
    numerics = Numerics(quantization="int8" if kind == "int8" else None, kernels=PRODUCTS)
    served = jax.jit(lambda x, w: numerics.matmul(spec, x, w))
    assert f"@{target(kind)}(" in served.lower(x, w).as_text()  # the kernel's product, not XLA's
    got = served(x, w)
    want = jax.jit(lambda x, w: quantized.einsum(spec, x, w))(x, w)
    assert got.shape == want.shape and got.dtype == jnp.float32
    truth = exact(spec, x, w)
    scale = np.abs(truth).max()
    assert np.abs(np.asarray(got) - truth).max() <= 2e-6 * scale * np.sqrt(x[0].size)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec,shape,contracted", [s for s in SPECS[:3]])
def test_a_layer_of_a_stack_is_read_where_it_lies_as_its_slice_would_be(kind, spec, shape, contracted):
    """What the layer scan hands Numerics in a step of few rows (decoder.py): the stack whole and the
    layer's row. Each layer's product is its own weight's, bit for bit, and no instruction of the
    compiled scan writes a layer's weight out (XLA's way slices it out first, and the detector sees it)."""
    rng = np.random.default_rng(4)
    layers = 3
    stack = weight(kind, rng.standard_normal((layers, *shape)).astype(np.float32), tuple(a + 1 for a in contracted))
    x = rng.standard_normal((2, *(shape[a] for a in contracted))).astype(np.float32)

    def scanned(numerics):
        def layer(_, row):
            return None, numerics.matmul(spec, x, StackLayer(stack, row))
        return jax.jit(lambda: jax.lax.scan(layer, None, jnp.arange(layers))[1])

    quantization = "int8" if kind == "int8" else None
    kernel, xla = (scanned(Numerics(quantization=quantization, kernels=k)) for k in (PRODUCTS, None))
    got = np.asarray(kernel())
    for row in range(layers):
        alone = jax.tree.map(lambda a: a[row], stack)
        np.testing.assert_array_equal(got[row], np.asarray(product(*_merged_spec(spec, x, alone, contracted))).reshape(got[row].shape))
    np.testing.assert_allclose(got, xla(), rtol=0, atol=1e-5 * np.abs(got).max())
    assert weight_writes(kernel.lower().compile().as_text(), [shape]) == []
    if spec == "TD,DF->TF":  # the detector sees XLA's slice (for the other specs XLA fuses it into its product)
        assert weight_writes(xla.lower().compile().as_text(), [shape])


def _merged_spec(spec, x, w, contracted):
    """(spec, x, w) with o's two contracted axes merged, as Numerics hands the kernel a layer's o."""
    if len(contracted) == 1:
        return spec, x, w
    merged = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), w)
    return "TX,XD->TD", x.reshape(x.shape[0], -1), merged


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec,shape,contracted", [s for s in SPECS if s[0] in ("TD,DF->TF", "RD,VD->RV")])
def test_each_row_is_a_function_of_its_own_row_alone_bit_for_bit(kind, spec, shape, contracted):
    rng = np.random.default_rng(2)
    w = weight(kind, rng.standard_normal(shape).astype(np.float32), contracted)
    x = rng.standard_normal((8, *(shape[a] for a in contracted))).astype(np.float32)
    together = np.asarray(product(spec, x, w))
    for row in range(8):
        np.testing.assert_array_equal(np.asarray(product(spec, x[row:row + 1], w))[0], together[row])
    others = x.copy()
    others[1:] = rng.standard_normal(others[1:].shape)
    np.testing.assert_array_equal(np.asarray(product(spec, others[:5], w))[0], together[0])
    for _ in range(5):  # the threads take the parts in another order each time; the sums stay put
        np.testing.assert_array_equal(np.asarray(product(spec, x, w)), together)


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec,shape,contracted", [s for s in SPECS if s[0] != "RD,VD->RV"])
def test_products_of_9_to_32_rows_go_by_columns_each_row_alone_bit_for_bit(kind, spec, shape, contracted):
    """Past 8 rows a product is split by output columns (product_kernel.cc's `columns`): XLA's
    product within float32 rounding, and each row's output the same bits in any step of 9 to 32 rows."""
    rng = np.random.default_rng(6)
    w = weight(kind, rng.standard_normal(shape).astype(np.float32), contracted)
    x = rng.standard_normal((32, *(shape[a] for a in contracted))).astype(np.float32)
    served = jax.jit(lambda x, w: Numerics(quantization="int8" if kind == "int8" else None, kernels=PRODUCTS).matmul(spec, x, w))
    assert f"@{target(kind)}(" in served.lower(x, w).as_text()
    got = np.asarray(served(x, w))
    truth = exact(spec, x, w)
    assert np.abs(got - truth).max() <= 2e-6 * np.abs(truth).max() * np.sqrt(x[0].size)
    nine = np.asarray(served(np.concatenate([x[5:6], rng.standard_normal((8, *x.shape[1:])).astype(np.float32)]), w))
    np.testing.assert_array_equal(nine[0], got[5])


@needs_kernel
def test_what_the_kernel_does_not_take_is_left_to_xla():
    rng = np.random.default_rng(3)
    f = rng.standard_normal((16, 24)).astype(np.float32)
    q, w = QArray(*quantize(f, (0,))), jnp.asarray(f)
    x = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
    for taken in (q, w):
        assert product_kernel.product("TD,DF->TF", x, taken) is not None
        assert product_kernel.product("TD,DF->TF", x, taken, preferred_element_type=jnp.float32) is not None
        limit = product_kernel.MAX_ROWS
        assert product_kernel.product("TD,DF->TF", jnp.concatenate([x] * 4)[:limit], taken) is not None
        assert product_kernel.product("TD,DF->TF", jnp.concatenate([x] * 5)[:limit + 1], taken) is None
        assert product_kernel.product("TD,DF->TF", x.astype(jnp.bfloat16), taken) is None
        assert product_kernel.product("TD,DF->TF", x, taken, preferred_element_type=jnp.bfloat16) is None
        assert product_kernel.product("TD,DF->FT", x, taken) is None  # rows not leading the output
    assert product_kernel.product("TD,DF->TF", x, w.astype(jnp.bfloat16)) is None  # bfloat16 weights
    assert product_kernel.product("TD,DF->TF", x, QArray(q.values.astype(jnp.float32), q.scale)) is None  # not int8 values
    o = QArray(*quantize(rng.standard_normal((2, 8, 24)).astype(np.float32), (0, 1)))
    assert product_kernel.product("TNH,NHD->TD", x.reshape(8, 2, 8), o) is None  # Numerics merges N, H first
    assert product_kernel.product("TNH,NHD->TD", x.reshape(8, 2, 8), o.values.astype(jnp.float32)) is None
    experts = QArray(*quantize(rng.standard_normal((4, 16, 24)).astype(np.float32), (1,)))
    assert product_kernel.product("TEF,EFD->TD", x.reshape(8, 1, 16).repeat(4, 1), experts) is None
    per_tensor = QArray(q.values, jnp.ones((1, 1), jnp.float32))  # not a scale per output channel
    assert product_kernel.product("TD,DF->TF", x, per_tensor) is None
    assert product_kernel.product("TD,DF->TF", x, jnp.stack([w, w]), jnp.int32(1)) is not None  # a layer of a stack
    assert product_kernel.product("TD,DF->TF", x, jnp.stack([w, w])) is None  # a stack without its row
    for table in (w.T, QArray(q.values.T, q.scale.T)):  # a head's [V, D]: 8 rows at most
        assert product_kernel.product("RD,VD->RV", x, table) is not None
        assert product_kernel.product("RD,VD->RV", jnp.concatenate([x, x[:1]]), table) is None


@needs_kernel
@pytest.mark.parametrize("name,quantization", [("llama", "int8"), ("llama", None), ("qwen3_moe", "int8")])
def test_a_tiny_model_serves_with_the_kernel_as_without_it(name, quantization):
    """A tied head and an untied one, QK-norm and experts, int8 and float32 weights."""
    model_cls, cfg = (Llama, TINY) if name == "llama" else MODELS[name]
    without, with_kernel = (Engine(built(model_cls, replace(cfg, numerics=Numerics(quantization=quantization, kernels=k))),
                                   BUCKETS, PAGE_SIZE, NUM_PAGES) for k in (None, PRODUCTS))
    shapes = with_kernel.buckets.shapes()
    one, many = next(s for s in shapes if s[0] == 1), max(shapes, key=lambda s: s[0])  # 1 and 16 tokens
    call = f"@{target('int8' if quantization else 'float32')}("

    def calls(engine, shape):
        return engine.executables.lower_forward(shape).as_text().count(call)
    # A layer's 7 projections (one scan body; Qwen3-MoE's expert layers add a body of their 4
    # attention projections, the experts staying XLA's) and the head, in a step of one token and in
    # one of 16 (its layers by columns; its head on the step's sampled rows, at most 8 here).
    projections = 7 + 4 * (name == "qwen3_moe") + 1
    assert (calls(with_kernel, one), calls(with_kernel, many), calls(without, one)) == (projections, projections, 0)
    a, b = logits(without), logits(with_kernel)  # a prefill and decode steps, all of at most 8 tokens
    assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-4)


def test_the_engine_turns_the_kernel_on_only_where_it_applies(monkeypatch, caplog):
    monkeypatch.setattr(product_kernel, "load", lambda: "")
    for on in ([], ["worker.quantization=int8"]):  # float32 weights and int8 ones
        assert products(start.numerics(load_config(on)))
        assert not products(start.numerics(load_config(on), devices=2))  # a mesh: GSPMD would gather the weights
        assert not products(start.numerics(load_config([*on, "worker.batch_invariant=true"])))
        assert not products(start.numerics(load_config([*on, "worker.product_kernel=false"])))
    assert start.numerics(load_config(["worker.product_kernel=false", "worker.attention_kernel=false"])).kernels is None
    monkeypatch.setattr(product_kernel, "load", lambda: "no C++ compiler (c++, g++, clang++ or $CXX) on PATH")
    with caplog.at_level(logging.WARNING, logger="worker_svc.start"):
        assert not products(start.numerics(load_config([])))
    assert "weight products run in XLA" in caplog.text and "no C++ compiler" in caplog.text


@pytest.mark.parametrize("kernel", [product_kernel, attention_kernel])  # build.py builds both
def test_a_build_that_fails_says_why_in_one_line(monkeypatch, tmp_path, kernel):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails whatever it is given
    with pytest.raises(RuntimeError, match=rf"^false could not build {kernel.KERNEL.source.name}: "):
        kernel.KERNEL.build(tmp_path)
    assert not list(tmp_path.glob("*.so"))
