"""layers/deepseek_moe.py alone against transformers' DeepseekV3MoE and DeepseekV2Moe (PyTorch, CPU,
float32): each variant's MoE layer of a tiny random model saved by save_pretrained, its tensors copied
into ours by MOE_CHECKPOINT's names; the same outputs and the same chosen experts on random tokens
under `fused` and `ep`, and under `ep` with the experts split over 2 fake CPU devices (deepseek_moe_ep.py,
run in the suite's idle time, tests/background.py); int8 experts; routing replay; the rule's refusals.

    python -m pytest tests/model/test_deepseek_moe.py
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import background
from tests.model.parity import redraw
from worker_svc.layers.deepseek_moe import MOE_CHECKPOINT, TO_HF, DeepseekMoE, Routing, route
from worker_svc.layers.moe import Routed
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.quantized import dequantize, fills, leaf_values

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Layer 0 dense, layer 1 MoE: 16 experts in 4 groups of 4, 2 groups kept, 4 experts chosen, 2 shared.
SHAPES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
              topk_group=2, n_shared_experts=2)
# variant -> (transformers' class names, its config's routing numbers, ours as DeepseekMoE takes them)
VARIANTS = {
    "v3": ("DeepseekV3", dict(norm_topk_prob=True, routed_scaling_factor=2.5),
           dict(scoring="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=2.5)),
    "v2": ("DeepseekV2", dict(topk_method="group_limited_greedy", routed_scaling_factor=1.5),
           dict(scoring="softmax", topk_method="group_limited_greedy", norm_topk_prob=False, routed_scaling_factor=1.5)),
    "v2_greedy": ("DeepseekV2", dict(topk_method="greedy", routed_scaling_factor=1.5),
                  dict(scoring="softmax", topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.5)),
}
SHARDED = ("v3", "v2")  # deepseek_moe_ep.py's: the greedy choice splits as the others do
LAYER, TOKENS, TOLERANCE = 1, 64, 1e-5


def hf_layer(variant: str, directory: Path):
    """(transformers' MoE module of layer LAYER, the checkpoint's tensors by name) of the variant's tiny
    model, seeded, its weights and correction bias redrawn, saved to `directory` and read back."""
    from safetensors.numpy import load_file

    prefix, numbers, _ = VARIANTS[variant]
    torch.manual_seed(0)
    config = getattr(transformers, f"{prefix}Config")(**SHAPES, **numbers)
    model = redraw(getattr(transformers, f"{prefix}ForCausalLM")(config))
    gate = model.model.layers[LAYER].mlp.gate
    if hasattr(gate, "e_score_correction_bias"):  # a buffer, not a parameter: redraw's not; spread like the scores'
        with torch.no_grad():
            gate.e_score_correction_bias.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    return model.model.layers[LAYER].mlp, load_file(str(directory / "model.safetensors"))


def ours(variant: str, tensors: dict, strategy: str = "fused", numerics: Numerics = Numerics(), shards=None) -> DeepseekMoE:
    """Our layer for `variant`, each parameter (an int8 one's values and scale) filled by MOE_CHECKPOINT's names."""
    moe = DeepseekMoE(SHAPES["hidden_size"], SHAPES["moe_intermediate_size"], SHAPES["n_routed_experts"],
                      SHAPES["num_experts_per_tok"], shared_experts=SHAPES["n_shared_experts"], n_group=SHAPES["n_group"],
                      topk_group=SHAPES["topk_group"], strategy=strategy, numerics=numerics, dtype=jnp.float32,
                      rngs=nnx.Rngs(0), shards=shards, **VARIANTS[variant][2])
    for path, var, leaves in fills(nnx.to_flat_state(nnx.state(moe))):
        name, transform = MOE_CHECKPOINT[("mlp", *path)]
        names = [name.format(i=LAYER, j=j) for j in range(var.shape[0])] if "{j}" in name else [name.format(i=LAYER)]
        value = np.stack([transform(tensors[n], None) for n in names]) if "{j}" in name else transform(tensors[names[0]], None)
        for (_, leaf), array in zip(leaves, leaf_values(value, leaves)):
            leaf.set_value(jnp.asarray(np.asarray(array).astype(leaf.dtype)))
    return moe


def tokens() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((TOKENS, SHAPES["hidden_size"])).astype(np.float32)  # [T, D]


def run(moe: DeepseekMoE, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(output [T, D], the chosen experts it sowed [T, k])."""
    out, sown = nnx.jit(lambda m, x: nnx.capture(m, Routed)(x))(moe, jnp.asarray(x))
    return np.asarray(out), np.asarray(jax.tree.leaves(sown)[0])


def theirs(hf, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """transformers' (output [T, D], chosen experts [T, k], router logits [T, E])."""
    with torch.no_grad():
        logits, _, chosen = hf.gate(torch.from_numpy(x))
        return hf(torch.from_numpy(x)).numpy(), chosen.numpy(), logits.numpy()


@pytest.fixture(scope="module", params=list(VARIANTS))
def layer(request, tmp_path_factory):
    """(variant, transformers' module, the checkpoint's tensors, transformers' output, chosen, logits)."""
    hf, tensors = hf_layer(request.param, tmp_path_factory.mktemp(request.param))
    return (request.param, hf, tensors, *theirs(hf, tokens()))


def assert_same(variant: str, what: str, got: tuple, want_out: np.ndarray, want_chosen: np.ndarray) -> None:
    out, chosen = got
    diff = np.abs(out - want_out).max()
    print(f"{variant} {what}: max |diff| {diff:.1e} (output max {np.abs(want_out).max():.1f})")  # -rP
    assert diff <= TOLERANCE, (what, diff)
    # The same experts per token; transformers' order is torch.topk(sorted=False)'s (the module docstring).
    np.testing.assert_array_equal(np.sort(chosen, -1), np.sort(want_chosen, -1), err_msg=what)


@pytest.mark.parametrize("strategy", ["fused", "ep"])
def test_the_layer_matches_transformers(layer, strategy):
    variant, _, tensors, want_out, want_chosen, _ = layer
    assert_same(variant, strategy, run(ours(variant, tensors, strategy), tokens()), want_out, want_chosen)


@pytest.mark.parametrize("layer", ["v3", "v2"], indirect=True)  # the group-limited ones
def test_group_limiting_and_the_correction_bias_change_the_choice(layer):
    """Else the test above would not tell the group-limited rule from a plain top k (nor the bias from none)."""
    variant, hf, _, _, want_chosen, logits = layer
    scores = 1 / (1 + np.exp(-logits)) if variant == "v3" else np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    k, sets = SHAPES["num_experts_per_tok"], lambda ids: np.sort(ids, -1)
    changed = (sets(np.argsort(-scores, -1, kind="stable")[:, :k]) != sets(want_chosen)).any(-1)
    print(f"{variant}: group limiting changed {changed.sum()} of {TOKENS} tokens' experts")  # -rP
    assert changed.sum() >= TOKENS // 8
    if variant == "v3":
        unbiased = route(jnp.asarray(tokens()), jnp.asarray(hf.gate.weight.detach().numpy().T), None, rule(variant))[1]
        assert (sets(np.asarray(unbiased)) != sets(want_chosen)).any(-1).sum() >= TOKENS // 8


def rule(variant: str) -> Routing:
    numbers = VARIANTS[variant][2]
    return Routing(SHAPES["n_routed_experts"], SHAPES["num_experts_per_tok"], numbers["scoring"], numbers["topk_method"],
                   SHAPES["n_group"], SHAPES["topk_group"], numbers["norm_topk_prob"], numbers["routed_scaling_factor"])


@pytest.mark.parametrize("layer", ["v3"], indirect=True)  # the experts' arithmetic is moe.py's, whatever routes
def test_int8_experts_give_transformers_output_on_the_dequantized_weights(layer):
    """Under worker.quantization=int8 the experts' and shared experts' weights are int8 (the router stays
    float32): transformers run on those weights dequantized gives our output, under both strategies."""
    variant, hf, tensors, *_ = layer
    x = tokens()
    moes = {strategy: ours(variant, tensors, strategy, Numerics(quantization="int8")) for strategy in ("fused", "ep")}
    exact = {(module, name): np.asarray(dequantize(getattr(getattr(moes["fused"], module), name)[...], jnp.float32))
             for module in ("experts", "shared") for name in ("gate", "up", "down")}
    saved = {name: p.detach().clone() for name, p in hf.named_parameters()}
    with torch.no_grad():  # transformers holds each expert's gate and up as one [E, 2F, D], down as [E, D, F]
        hf.experts.gate_up_proj.copy_(torch.tensor(np.concatenate([exact["experts", "gate"], exact["experts", "up"]], -1)
                                                   .transpose(0, 2, 1)))
        hf.experts.down_proj.copy_(torch.tensor(exact["experts", "down"].transpose(0, 2, 1)))
        for name in ("gate", "up", "down"):
            getattr(hf.shared_experts, f"{name}_proj").weight.copy_(torch.tensor(exact["shared", name].T))
    try:
        want_out, want_chosen, _ = theirs(hf, x)
    finally:
        with torch.no_grad():
            for name, p in hf.named_parameters():
                p.copy_(saved[name])
    for strategy, moe in moes.items():
        assert_same(variant, f"int8 {strategy}", run(moe, x), want_out, want_chosen)


@pytest.mark.parametrize("layer", ["v3"], indirect=True)
def test_under_batch_invariant_a_tokens_routing_is_the_same_alone_or_among_others(layer):
    """worker.batch_invariant (with `fused`): the router, like every row sum, runs in fixed row tiles, so a
    token's experts and weights are bit for bit the same alone as among 63 others (which they are not
    without the mode, on XLA:CPU, from a model dim of 256); and the layer's output is still transformers'."""
    variant, _, tensors, want_out, want_chosen, _ = layer
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((TOKENS, 256), np.float32), rng.standard_normal((256, 16), np.float32) / 16
    correction = rng.standard_normal(16, np.float32) / 10
    differs = {}
    for numerics in (Numerics(), Numerics(batch_invariant=True)):
        routing = jax.jit(lambda x: route(x, w, correction, rule(variant), numerics))
        among, alone = routing(x), routing(x[40:41])
        differs[numerics.batch_invariant] = [not np.array_equal(a[40:41], b) for a, b in zip(among, alone)]
    assert differs[True] == [False, False]
    if jax.default_backend() == "cpu":  # not vacuous: without the mode the weights moved by an ulp (not the choice)
        assert differs[False] == [True, False]
    moe = ours(variant, tensors, numerics=Numerics(batch_invariant=True))
    assert_same(variant, "batch_invariant", run(moe, tokens()), want_out, want_chosen)


def test_replayed_experts_are_used_and_weighted_from_the_same_scores(layer):
    variant, hf, tensors, _, want_chosen, logits = layer
    numbers, x = VARIANTS[variant][2], jnp.asarray(tokens())
    moe = ours(variant, tensors)
    w, correction = moe.router.w[...], None if moe.router.correction is None else moe.router.correction[...]
    own = route(x, w, correction, moe.router.rule)
    none_given = route(x, w, correction, moe.router.rule, replay=jnp.full(want_chosen.shape, -1, jnp.int32))
    np.testing.assert_array_equal(np.asarray(none_given[1]), np.asarray(own[1]))
    replay = np.roll(np.asarray(own[1]), 1, axis=0)  # the token before's experts, where a trainer's choice differs
    replay[::2, 0] = -1  # and one choice left to the router in every other token
    weights, chosen = (np.asarray(a) for a in route(x, w, correction, moe.router.rule, replay=jnp.asarray(replay)))
    np.testing.assert_array_equal(chosen, np.where(replay >= 0, replay, np.asarray(own[1])))
    scores = 1 / (1 + np.exp(-logits)) if numbers["scoring"] == "sigmoid" else np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    want = np.take_along_axis(scores, chosen, -1)
    if numbers["norm_topk_prob"]:
        want = want / want.sum(-1, keepdims=True)
    np.testing.assert_allclose(weights, want * numbers["routed_scaling_factor"], rtol=1e-5)


def test_the_names_are_the_checkpoints_and_every_transform_has_its_inverse(layer):
    variant, _, tensors, *_ = layer
    moe = ours(variant, tensors)
    names = set()
    for path, var in nnx.to_flat_state(nnx.state(moe)):
        name, transform = MOE_CHECKPOINT[("mlp", *path)]
        for j in range(var.shape[0]) if "{j}" in name else (None,):
            names.add(hf_name := name.format(i=LAYER, j=j))
            ours_at = np.asarray(var[...] if j is None else var[...][j])
            np.testing.assert_array_equal(TO_HF[transform](ours_at, None), tensors[hf_name], err_msg=hf_name)
    assert names == {name for name in tensors if name.startswith(f"model.layers.{LAYER}.mlp.")}


@pytest.mark.parametrize("change,message", [
    (dict(scoring="relu"), "scoring_func must be one of"),
    (dict(topk_method="topk"), "topk_method must be one of"),
    (dict(n_group=3), "n_group 3 does not divide n_routed_experts 16"),
    (dict(n_group=16), "noaux_tc scores by their two best"),
    (dict(topk_group=1, top_k=5), "topk_group 1 of n_group 4 keeps fewer than num_experts_per_tok 5"),
    (dict(top_k=17), "num_experts_per_tok 17 of n_routed_experts 16"),
])
def test_a_rule_that_cannot_choose_k_experts_is_refused_by_name(change, message):
    numbers = dict(experts=16, top_k=4, scoring="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
                   norm_topk_prob=True, routed_scaling_factor=2.5)
    with pytest.raises(ValueError, match=message):
        Routing(**(numbers | change))


@pytest.fixture(scope="module")
def deepseek_moe_sharded_runs():
    """deepseek_moe_ep.py's run on fake devices, started at the session's start (tests/conftest.py)."""
    return background.runs()


@pytest.fixture(scope="module")
def sharded(deepseek_moe_sharded_runs) -> dict[str, np.ndarray]:
    return deepseek_moe_sharded_runs.arrays("deepseek_moe_ep")


@pytest.mark.parametrize("variant", SHARDED)
def test_experts_split_over_devices_give_transformers_output(sharded, variant):
    """`ep` with the experts split over 2 fake devices (ep2: tokens exchanged all-to-all), and their F over
    2 more (tp2_ep2), against transformers on the same tokens (both run by deepseek_moe_ep.py)."""
    want = sharded[f"{variant}/transformers/out"], sharded[f"{variant}/transformers/chosen"]
    for layout in ("ep2", "tp2_ep2"):
        assert sharded[f"{variant}/{layout}/all_to_all"] > 0
        assert_same(variant, layout, (sharded[f"{variant}/{layout}/out"], sharded[f"{variant}/{layout}/chosen"]), *want)
