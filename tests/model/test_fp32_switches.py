"""worker.lm_head_fp32 and worker.router_fp32 with bfloat16 weights (layers/numerics.py): with the
switch, the served numbers equal a float32 reference computed from the same bfloat16 weights to
within float32 rounding; without it they differ measurably (bfloat16 rounding). Figures: `pytest -s`."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxstream import protocol
from tests.worker.driver import Driver
from worker_svc.batch import Buckets
from worker_svc.engine import Engine
from worker_svc.layers.attention import KVCache, PagedContext
from worker_svc.layers.moe import MoE
from worker_svc.layers.numerics import Numerics
from worker_svc.models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig

MOE = Qwen3MoeConfig(vocab=211, dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp_dim=96, rope_theta=10000.0,
                     norm_eps=1e-6, tie_embeddings=True, experts=8, top_k=2, moe_mlp_dim=32, norm_topk_prob=True,
                     moe_layers=(0,))
PAGE_SIZE, NUM_PAGES = 4, 64
BUCKETS = Buckets(tokens=(2, 32), pairs=(0, 256), max_rows=4, max_pages=16)
PROMPT = np.random.default_rng(2).integers(0, MOE.vocab, 9).tolist()
GREEDY = protocol.SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def bf16_model(numerics: Numerics) -> Qwen3Moe:
    model = Qwen3Moe(Qwen3MoeConfig(**{**MOE.__dict__, "numerics": numerics}), dtype=jnp.bfloat16, rngs=nnx.Rngs(4))
    table = model.embed.table  # N(0, 1) rows, so the logits are not flat and bfloat16's rounding shows
    table.set_value((jax.random.normal(jax.random.key(1), table.shape) * 1.0).astype(jnp.bfloat16))
    return model


def served_and_reference(numerics: Numerics) -> tuple[np.ndarray, np.ndarray]:
    """Greedy logprobs as served, and a float32 head's over the same tokens: the final norm and the
    tied head in float64 numpy from the model's own last-layer output (batch_invariant makes the
    one-pass trunk here the served steps' bits)."""
    model = bf16_model(numerics)
    trace = Driver(Engine(model, BUCKETS, PAGE_SIZE, NUM_PAGES), PAGE_SIZE, NUM_PAGES, 32, 4).run([("r", PROMPT, GREEDY)])["r"]
    tokens = PROMPT + trace.tokens[:-1]  # the inputs whose outputs were sampled from
    ctx = jax.tree.map(jnp.asarray, PagedContext.sequence(len(tokens), PAGE_SIZE))
    empty = jnp.zeros((MOE.layers, 1, PAGE_SIZE, MOE.kv_heads, MOE.head_dim), jnp.bfloat16)
    x, _ = nnx.jit(lambda m, t, c: m.trunk(t, c, KVCache(empty, empty)))(model, jnp.asarray(tokens), ctx)
    x = np.asarray(x, np.float64)[len(PROMPT) - 1:]
    h = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + MOE.norm_eps) * np.asarray(model.norm.scale[...], np.float64)
    logits = h @ np.asarray(model.embed.table[...], np.float64).T
    peak = logits.max(-1, keepdims=True)
    logprobs = logits - peak - np.log(np.exp(logits - peak).sum(-1, keepdims=True))
    return np.asarray(trace.logprobs), logprobs[np.arange(len(trace.tokens)), trace.tokens]


def test_lm_head_fp32_serves_the_float32_heads_logprobs():
    served, want = served_and_reference(Numerics(batch_invariant=True, lm_head_fp32=True))
    off, want_off = served_and_reference(Numerics(batch_invariant=True))
    on_diff, off_diff = np.abs(served - want).max(), np.abs(off - want_off).max()
    print(f"bf16 weights: max |served - float32 head| logprob {on_diff:.2e} with lm_head_fp32, {off_diff:.2e} without")
    # XLA keeps bfloat16 intermediates inside a fusion at float32 (xla_allow_excess_precision), so
    # without the switch the head's rounding shows less than bfloat16's 3 digits: 2.5e-6 measured.
    assert on_diff <= 2e-7
    assert off_diff >= 10 * on_diff


def test_router_fp32_keeps_the_routing_weights_of_a_float32_router():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((37, 64)), jnp.bfloat16)
    diffs = {}
    for fp32 in (True, False):
        moe = MoE(64, 32, 8, 2, norm_topk_prob=True, strategy="fused", numerics=Numerics(router_fp32=fp32), dtype=jnp.bfloat16,
                  rngs=nnx.Rngs(0))
        weights, chosen = nnx.jit(lambda m, x: m.router(x))(moe, x)
        logits = np.asarray(x, np.float64) @ np.asarray(moe.router.w[...], np.float64)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        picked = np.take_along_axis(probs, np.asarray(chosen), -1)
        assert (np.asarray(chosen) == np.argsort(-probs, -1, kind="stable")[:, :2]).all()
        diffs[fp32] = np.abs(np.asarray(weights, np.float64) - picked / picked.sum(-1, keepdims=True)).max()
        assert (weights.dtype == jnp.float32) == fp32
    print(f"bf16 weights: max |routing weight - float32 reference| {diffs[True]:.2e} with router_fp32, {diffs[False]:.2e} without")
    assert diffs[True] <= 1e-6
    assert diffs[False] >= 1e-4
