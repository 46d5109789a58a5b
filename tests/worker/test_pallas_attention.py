"""worker.attention_backend=pallas (worker_svc/pallas_kernels/): JAX's Pallas kernels run in
interpret mode on this CPU against the native jax.numpy path, over steps the engine builds:
decode, prefill chunks, a mixed step with a chunk after a cached prefix (a prefix hit), GQA ratios
1, 3 and 8, page sizes 16 and 64, soft-capping; the backend choice per platform and model; a tiny
Qwen3 served through the kernels gives transformers' greedy tokens; MoE's grouped matmul by the
TPU's megablox kernel, interpreted, against jax.lax.ragged_dot. Tests needing a GPU skip."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstream import protocol
from jaxstream.config import ConfigError, load_config
from worker_svc import attention_backend, start
from worker_svc.layers import attention
from worker_svc.pallas_kernels.kernels import PallasKernels

KV_HEADS, LAYERS, HEAD_DIM = 2, 2, 16
INTERPRETED = PallasKernels(interpret=True)
needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Pallas GPU kernels need a GPU")


def step(rows: list[tuple[int, int]], group: int, page_size: int, tokens: int, seed: int = 0):
    """q, k, v, a cache and the context of one step: a row per (cached, new) pair, its cached pages
    scattered over the pool, `tokens` tokens in all (the rest padding)."""
    rng = np.random.default_rng(seed)
    counts = [-(-(cached + new) // page_size) for cached, new in rows]
    pool = sum(counts) + 3
    shape = (LAYERS, pool, page_size, KV_HEADS, HEAD_DIM)
    cache = attention.KVCache(*(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2)))
    order = rng.permutation(pool).astype(np.int32)
    columns = max(1, max(-(-cached // page_size) for cached, _ in rows))
    pages, positions = np.zeros((tokens, columns), np.int32), np.zeros(tokens, np.int32)
    segment, cached_len = np.full(tokens, -1, np.int32), np.zeros(tokens, np.int32)
    t, first = 0, 0
    for row, ((cached, new), count) in enumerate(zip(rows, counts)):
        held = -(-cached // page_size)
        for i in range(new):
            pages[t, :held], positions[t], segment[t], cached_len[t] = order[first:first + held], cached + i, row, cached
            t += 1
        first += count
    ctx = attention.PagedContext.padded(tokens, 0, columns)._replace(positions=positions, segment=segment, pages=pages,
                                                                      cached=cached_len)
    q = jnp.asarray(rng.standard_normal((tokens, KV_HEADS * group, HEAD_DIM)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((tokens, KV_HEADS, HEAD_DIM)), jnp.float32) for _ in range(2))
    return q, k, v, cache, ctx


def attend(kernels, q, k, v, cache, ctx, softcap=None):
    run = jax.jit(lambda q, k, v, cache, ctx: attention.paged_attention(q, k, v, cache, jnp.int32(1), ctx, kernels=kernels,
                                                                         softcap=softcap))
    return np.asarray(run(q, k, v, cache, ctx))[np.asarray(ctx.segment) >= 0]  # padding tokens' outputs are nobody's


DECODE = [(0, 1), (1, 1), (16, 1), (37, 1), (130, 1)]  # nothing cached, a page's edge, several pages and partitions
MIXED = [(45, 1), (0, 20), (70, 9)]  # a decode row, a fresh prompt's chunk, a chunk after a cached prefix


@pytest.mark.parametrize("group, page_size", [(1, 64), (3, 16), (8, 64)])  # each ratio once, each page size (lean)
def test_interpreted_kernels_match_native_attention(group, page_size):
    """Decode (the cache by the paged kernel, own keys in jax.numpy: too few tokens for the flash
    kernel's block) and a mixed step of 32 tokens (both kernels)."""
    for rows, tokens in ((DECODE, len(DECODE)), (MIXED, 32)):
        case = step(rows, group, page_size, tokens)
        np.testing.assert_allclose(attend(INTERPRETED, *case), attend(None, *case), rtol=0, atol=2e-6)


def test_soft_capped_scores_match_native():
    """The paged kernel caps the cache's scores; the step's own (the flash kernel has no cap) run in jax.numpy."""
    case = step(MIXED, 8, 16, 32, seed=1)  # and GQA 8 over pages of 16
    np.testing.assert_allclose(attend(INTERPRETED, *case, softcap=5.0), attend(None, *case, softcap=5.0), rtol=0, atol=2e-6)


def test_a_window_or_another_dtype_is_left_to_native():
    q, k, v, cache, ctx = step(DECODE, 1, 16, len(DECODE))
    args = (q.reshape(len(DECODE), KV_HEADS, 1, HEAD_DIM), cache.k, cache.v, jnp.int32(0), ctx.pages, ctx.cached)
    assert INTERPRETED.cached_state(*args, lowest=jnp.zeros(len(DECODE), jnp.int32)) is None
    assert INTERPRETED.own_state(args[0], k, v, ctx.segment, window=jnp.int32(8)) is None
    assert not INTERPRETED.attends(jnp.float32, attention.BF16_BITS, 1, HEAD_DIM)  # bfloat16 bits under float32
    assert not INTERPRETED.attends(jnp.float32, jnp.float32, 1, 576)  # a latent's width
    assert INTERPRETED.attends(jnp.bfloat16, jnp.bfloat16, 8, 128)


QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}


@pytest.mark.parametrize("platform, devices, asked, expected", [
    ("cpu", 1, "auto", "cpu_kernel"), ("gpu", 1, "auto", "pallas"), ("tpu", 1, "auto", "native"), ("gpu", 2, "auto", "native"),
    ("cpu", 1, "pallas", "pallas"), ("gpu", 1, "native", "native"), ("cpu", 1, "cpu_kernel", "cpu_kernel"),
])
def test_the_backend_each_platform_runs(platform, devices, asked, expected):
    worker = load_config([f"worker.attention_backend={asked}"]).worker
    assert attention_backend.choose(worker, platform, devices, QWEN3)[0] == expected


def test_auto_on_cpu_without_the_attention_kernel_is_native():
    worker = load_config(["worker.attention_kernel=false"]).worker
    assert attention_backend.choose(worker, "cpu", 1)[0] == "native"


@pytest.mark.parametrize("platform, devices, asked, named", [
    ("gpu", 1, "cpu_kernel", "the CPU platform only"), ("tpu", 1, "pallas", "not wired for TPU"), ("gpu", 2, "pallas", "one device"),
])
def test_a_backend_the_platform_cannot_run_is_refused_by_key(platform, devices, asked, named):
    worker = load_config([f"worker.attention_backend={asked}"]).worker
    with pytest.raises(ConfigError, match=f"worker.attention_backend: .*{named}"):
        attention_backend.choose(worker, platform, devices)


def test_an_unknown_backend_is_refused_by_key():
    with pytest.raises(ConfigError, match="worker.attention_backend"):
        load_config(["worker.attention_backend=flash"])


@pytest.mark.parametrize("config, lacking", [
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096, "num_hidden_layers": 2}, "sliding window"),
    ({"architectures": ["Gemma2ForCausalLM"]}, "sliding window"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512}, "latent attention"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": None, "num_hidden_layers": 2}, ""),
])
def test_a_model_the_kernels_do_not_take_runs_native_and_says_why(config, lacking):
    worker = load_config(["worker.attention_backend=pallas"]).worker
    backend, why = attention_backend.choose(worker, "gpu", 1, config)
    assert (backend, lacking in why) == (("native", True) if lacking else ("pallas", True))


def test_start_up_hands_the_model_the_interpreted_kernels(caplog):
    with caplog.at_level(logging.INFO, logger="worker_svc.start"):
        numerics = start.numerics(load_config(["worker.attention_backend=pallas"]), hf_config=QWEN3)
    assert numerics.kernels == INTERPRETED and "interpret mode" in caplog.text
    native = start.numerics(load_config(["worker.attention_backend=native"])).kernels  # the product kernel's alone, if built
    assert native is None or not native.attention


def test_a_tiny_qwen3_through_the_kernels_gives_transformers_greedy_tokens(tmp_path, monkeypatch):
    """Our Qwen3 loaded with the Pallas backend's Numerics, prompts through the real scheduler core
    (chunked prefill beside decode, then a prefix hit), against transformers' generate; both
    kernels traced into the steps."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.model.parity import BUCKETS, NUM_PAGES, PAGE_SIZE, random_prompts, redraw, run_with_a_prefix_hit
    from tests.model.test_qwen3_parity import CONFIG
    from worker_svc.engine import Engine
    from worker_svc.loading import load_model
    from worker_svc.pallas_kernels import attention as kernels
    from worker_svc.weights import open_checkpoint

    traced = set()
    for name in ("cached_state", "own_state"):
        monkeypatch.setattr(kernels, name, lambda *a, _f=getattr(kernels, name), _n=name: traced.add(_n) or _f(*a))

    torch.manual_seed(0)
    hf = redraw(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG)))
    hf.save_pretrained(tmp_path)
    checkpoint = open_checkpoint(tmp_path)
    numerics = start.numerics(load_config(["worker.attention_backend=pallas"]), hf_config=checkpoint.config)
    assert numerics.kernels == INTERPRETED
    engine = Engine(load_model(checkpoint, progress=False, numerics=numerics), BUCKETS, PAGE_SIZE, NUM_PAGES)
    prompts = random_prompts(CONFIG["vocab_size"])
    requests = [(f"p{i}", p) for i, p in enumerate(prompts)] + [("hit", prompts[0][:60] + [7, 8, 9])]
    greedy = protocol.SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    traces = run_with_a_prefix_hit(engine, requests, greedy)
    for rid, prompt in requests:
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
        assert traces[rid].tokens == theirs, rid
    assert traced == {"cached_state", "own_state"}


@needs_gpu
def test_compiled_kernels_match_native_on_the_gpu():
    case = step(MIXED, 8, 16, 32)
    np.testing.assert_allclose(attend(PallasKernels(), *case), attend(None, *case), rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_megablox_grouped_matmul_matches_ragged_dot(dtype):
    """MoE's grouped matmul by the TPU's megablox kernel, interpreted: rows in groups of every size
    (an empty one), rows past every group (the exchange's padding) 0, rows not a whole tile."""
    from worker_svc.layers.numerics import Numerics
    from worker_svc.layers.quantized import ragged_dot

    rng = np.random.default_rng(0)
    rows, w = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in ((45, 40), (4, 40, 72)))
    sizes = jnp.array([10, 0, 25, 5], jnp.int32)
    row_group = jnp.repeat(jnp.arange(5, dtype=jnp.int32), np.array([10, 0, 25, 5, 5]))
    numerics = Numerics(kernels=PallasKernels(attention=False, grouped=True, interpret=True))
    got = np.asarray(jax.jit(numerics.ragged_dot)(rows, w, sizes, row_group), np.float32)
    want = np.asarray(ragged_dot(rows, w, sizes, row_group), np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-2 if dtype == jnp.bfloat16 else 1e-5, atol=2e-2 if dtype == jnp.bfloat16 else 1e-4)
    assert not np.any(got[40:])


@pytest.mark.parametrize("clamped", [False, True], ids=["swiglu", "gpt_oss"])
def test_moe_ep_layers_through_megablox_match_ragged_dot(clamped):
    """An MoE layer (moe=ep: Qwen3-MoE's experts, and GPT-OSS's gate-up ones with biases) whose
    grouped matmuls run by megablox, interpreted, against jax.lax.ragged_dot's, on the same weights."""
    from flax import nnx

    from worker_svc.layers.moe import ClampedSwiGLU, MoE
    from worker_svc.layers.numerics import Numerics

    x = jnp.asarray(np.random.default_rng(0).standard_normal((13, 64)), jnp.float32)
    out = []
    for kernels in (None, PallasKernels(attention=False, grouped=True, interpret=True)):
        layer = MoE(64, 32, 8, 2, norm_topk_prob=True, strategy="ep", numerics=Numerics(kernels=kernels), dtype=jnp.float32,
                    rngs=nnx.Rngs(3), clamped=ClampedSwiGLU(1.702, 7.0) if clamped else None)
        out.append(np.asarray(nnx.jit(lambda layer, x: layer(x))(layer, x)))
    np.testing.assert_allclose(out[1], out[0], rtol=0, atol=1e-5)
