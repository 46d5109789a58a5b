"""layers/moe.py alone against a float64 numpy reference written from the definition: softmax over the
experts, the top k, renormalized or not, and the weighted sum of the chosen experts' SwiGLU outputs."""

import jax
import numpy as np
import pytest
from flax import nnx

from worker_svc.layers.moe import MoE

DIM, HIDDEN, EXPERTS, TOP_K = 16, 24, 8, 2


def reference(x, router, gate, up, down, top_k, norm_topk_prob):
    """x [T, D], router [D, E], gate and up [E, D, F], down [E, F, D] -> [T, D], token by token."""
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(len(x)):
        chosen = np.argsort(-probs[t], kind="stable")[:top_k]
        weights = probs[t, chosen] / (probs[t, chosen].sum() if norm_topk_prob else 1.0)
        for e, w in zip(chosen, weights):
            g = x[t] @ gate[e]
            out[t] += w * ((g / (1 + np.exp(-g)) * (x[t] @ up[e])) @ down[e])
    return out


@pytest.mark.parametrize("tokens", [1, 5, 37])  # 1 and 5: most experts get no rows (empty ragged groups)
@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["normed", "unnormed"])
def test_both_strategies_match_the_reference(tokens, norm_topk_prob):
    x = np.random.default_rng(tokens).standard_normal((tokens, DIM)).astype(np.float32)
    outputs = {}
    for strategy in ("fused", "ep"):
        moe = MoE(DIM, HIDDEN, EXPERTS, TOP_K, norm_topk_prob=norm_topk_prob, strategy=strategy, dtype=np.float32, rngs=nnx.Rngs(0))
        outputs[strategy] = np.asarray(nnx.jit(lambda m, x: nnx.capture(m)(x))(moe, x))  # capture: nothing sown kept
    params = [np.asarray(p[...], np.float64) for p in (moe.router.w, moe.experts.gate, moe.experts.up, moe.experts.down)]
    want = reference(x.astype(np.float64), *params, TOP_K, norm_topk_prob)
    for strategy, got in outputs.items():
        diff = np.abs(got - want).max()
        print(f"{tokens} tokens, {strategy}: max |diff| vs float64 reference {diff:.2e} (output std {want.std():.2f})")  # -rP
        assert diff <= 1e-5 * max(1.0, np.abs(want).max()), strategy
    assert np.abs(outputs["fused"] - outputs["ep"]).max() <= 1e-5


def test_an_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="MoE strategy must be one of"):
        MoE(DIM, HIDDEN, EXPERTS, TOP_K, norm_topk_prob=True, strategy="dense", dtype=np.float32, rngs=nnx.Rngs(0))


def test_the_expert_weights_are_named_for_sharding():
    moe = nnx.eval_shape(lambda: MoE(DIM, HIDDEN, EXPERTS, TOP_K, norm_topk_prob=True, strategy="ep", dtype=jax.numpy.float32,
                                     rngs=nnx.Rngs(0)))
    names = {path: var.out_sharding for path, var in nnx.to_flat_state(nnx.state(moe))}
    assert names == {
        ("router", "w"): ("embed", "expert"),
        ("experts", "gate"): ("expert", "embed", "mlp"),
        ("experts", "up"): ("expert", "embed", "mlp"),
        ("experts", "down"): ("expert", "mlp", "embed"),
    }
