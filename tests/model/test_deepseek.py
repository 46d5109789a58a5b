"""DeepSeek-V3 and DeepSeek-V2, small random configs: our worker against transformers' DeepseekV3ForCausalLM
and DeepseekV2ForCausalLM (PyTorch, CPU, float32) on the same weights (every one redrawn, parity.py),
saved by transformers and read back by our loader. Two dense layers, then two of DeepSeek's MoE (4 groups
of 2 experts, 2 groups kept, a shared expert). V3: q through its low-rank projection, YaRN rotary with
DeepSeek's mscale (its softmax_scale too), interleaved rotary pairs, sigmoid routing with the correction
bias; V2: q projected directly, the default rotary, V2's complex (interleaved) rotation, softmax routing,
group_limited_greedy. As in test_gpt_oss.py: prompts through the real scheduler core (chunked prefill
beside batched decode through the paged latent cache), then a request whose first pages are a prefix-cache
hit, with the numerics served on this machine; and tp2, ep2 and batch_invariant (deepseek_tp.py, in the
suite's idle time); the routed experts as transformers' router picks them; n-gram drafts change no token
or logit; the weights read back by name; int8 weights; the cache's bytes per token; configs refused by name.

    python -m pytest tests/model/test_deepseek.py -rP    # also prints the largest differences
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxstream import protocol
from jaxstream.config import load_config
from scheduler_svc.ngram import NgramDrafter
from tests.model.deepseek_tp import RUNS
from tests.model.gpt_oss_tp import GREEDY, parity_requests
from tests.model.parity import (BUCKETS, BUDGET, NEW_TOKENS, NUM_PAGES, PAGE_SIZE, assert_refused,
                                assert_routed_experts_are_transformers, assert_weights_read_back, random_prompts, redraw,
                                run_with_a_prefix_hit)
from tests.worker.driver import Driver
from worker_svc import start
from worker_svc.engine import Engine
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.paged import PagedContext
from worker_svc.loading import load_model
from worker_svc.weights import open_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4  # max |logit difference|, float32
LAYERS = 4
FIRST_DENSE = 2  # layers 0, 1 dense (first_k_dense_replace), 2, 3 MoE
RANK, ROPE_DIM = 32, 8  # kv_lora_rank, qk_rope_head_dim: the latent cache's R + Dr a token and layer
V3 = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=LAYERS,
          num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=RANK, qk_nope_head_dim=16,
          qk_rope_head_dim=ROPE_DIM, v_head_dim=24, first_k_dense_replace=FIRST_DENSE, n_routed_experts=8,
          num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
          rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
          rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0,
                           "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0})
V2 = {**V3, "q_lora_rank": None, "topk_method": "group_limited_greedy", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
FAMILIES = {"v3": ("DeepseekV3", V3), "v2": ("DeepseekV2", V2)}


def hf_model(family: str):
    name, numbers = FAMILIES[family]
    torch.manual_seed(0)
    hf = redraw(getattr(transformers, f"{name}ForCausalLM")(getattr(transformers, f"{name}Config")(**numbers)))
    hf.generation_config.eos_token_id = None  # greedy for NEW_TOKENS whatever it samples, as GREEDY ignores EOS
    return hf


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(family, transformers model, its saved directory, {name: our Engine}, transformers' answers (`expected`): both MoE strategies under the
    numerics served on this machine (the CPU kernels where they build; the attention kernel is not MLA's),
    and batch_invariant (with `fused`))."""
    hf = hf_model(request.param)
    out = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(out)
    checkpoint, served = open_checkpoint(out), start.numerics(load_config([]))
    engines = {"fused": Engine(load_model(checkpoint, progress=False, numerics=served), BUCKETS, PAGE_SIZE, NUM_PAGES,
                               routed_experts=True)}
    return request.param, hf, out, engines, expected(hf, V3["vocab_size"])


def expected(hf, vocab: int) -> dict:
    """transformers' greedy tokens and the logits before each, per request."""
    answers = {}
    for rid, prompt in parity_requests(vocab):
        with torch.no_grad():
            tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()
            answers[rid] = tokens, hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].numpy()
    return answers


def test_logits_match_transformers_through_chunked_prefill_decode_and_a_prefix_cache_hit(family):
    name, _, _, engines, want = family
    requests = parity_requests(V3["vocab_size"])
    worst = {}
    for what, engine in engines.items():
        traces = run_with_a_prefix_hit(engine, requests, GREEDY)
        for rid, (tokens, _) in want.items():
            assert traces[rid].tokens == tokens, f"{what} {rid}"
        worst[what] = max(float(np.abs(np.stack(traces[rid].logits) - logits).max()) for rid, (_, logits) in want.items())
    print(f"deepseek {name}: max |logit diff| over 4 requests, {NEW_TOKENS} steps each: "
          + ", ".join(f"{w} {d:.2e}" for w, d in worst.items()) + f" (logit std {want['p0'][1].std():.2f})")  # -rP
    assert max(worst.values()) <= TOLERANCE, worst


@pytest.fixture(scope="module")
def sharded(deepseek_sharded_runs) -> dict:
    """deepseek_tp.py's results, run in the suite's idle time (tests/background.py)."""
    return deepseek_sharded_runs.arrays("deepseek_tp")


def test_tensor_and_expert_parallel_and_batch_invariant_runs_match_transformers_too(family, sharded):
    """tp2 (`fused`: heads split, the latent cache replicated), ep2 (`ep`) on fake devices and batch_invariant,
    the same checkpoint (hf_model is seeded). None of their forward steps copies the cache."""
    name, _, _, _, want = family
    worst = {}
    for run in RUNS:
        for rid, (tokens, _) in want.items():
            assert sharded[f"{name}/{run}/{rid}/tokens"].tolist() == tokens, f"{run} {rid}"
        worst[run] = max(float(np.abs(sharded[f"{name}/{run}/{rid}/logits"] - logits).max()) for rid, (_, logits) in want.items())
        assert sharded[f"{name}/{run}/cache_copies"] == 0, run
    print(f"deepseek {name}: max |logit diff| " + ", ".join(f"{run} {d:.2e}" for run, d in worst.items()))  # -rP
    assert max(worst.values()) <= TOLERANCE, worst


def test_ngram_drafts_change_no_token_or_logit(family):
    """scheduler.speculative=ngram: a draft's rows verified through the latent cache give what one token a step gives."""
    _, _, _, engines, _ = family
    block = random_prompts(V3["vocab_size"])[1]
    requests = [("repeats", block * 4, protocol.SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))]
    runs = {}
    for drafter in (None, NgramDrafter(4, 1, 3)):
        driver = Driver(engines["fused"], PAGE_SIZE, NUM_PAGES, BUDGET, 4, keep_logits=True, drafter=drafter)
        runs[drafter is None] = driver.run(requests)["repeats"], driver
    (plain, _), (drafted, driver) = runs[True], runs[False]
    assert driver.scheduler.core.stats()["spec_decode_num_accepted_tokens_total"] > 0
    assert drafted.tokens == plain.tokens
    np.testing.assert_allclose(np.array(drafted.logits), np.array(plain.logits), atol=1e-5)


def test_routed_experts_are_the_ones_transformers_router_picks(family):
    """Each token's set (transformers' torch.topk is unsorted); the dense layers' zeros."""
    _, hf, _, engines, _ = family
    assert_routed_experts_are_transformers(hf, engines, "gate", V3["vocab_size"], V3["num_experts_per_tok"], as_sets=True)


def test_the_weights_read_back_by_hugging_face_name_are_the_checkpoints(family):
    _, _, out, engines, _ = family
    assert_weights_read_back(engines["fused"], out)


def routed_forward(model, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Logits [T, V] of one sequence in one pass, nothing cached, and each token's routed experts [T, L, k], sorted."""
    ctx = jax.tree.map(jnp.asarray, PagedContext.padded(len(tokens), 0)._replace(positions=np.arange(len(tokens), dtype=np.int32),
                                                                                 segment=np.zeros(len(tokens), np.int32)))
    spec = model.cache_spec()
    cache = spec.cache({name: jnp.zeros(shape) for name, shape in spec.shapes(model.cfg.layers, 1, 4).items()})
    out = nnx.jit(lambda m, t: m(t, ctx, cache, jnp.arange(len(tokens)), experts=True))(model, jnp.asarray(tokens))
    return np.asarray(out[0]), np.sort(np.asarray(out[3]), axis=-1).transpose(1, 0, 2)


def test_int8_weights_give_transformers_logits_within_quantization_error(family):
    """parity.py's int8 check, at the tokens whose experts int8 routes as float32 does: V3's group-limited
    sigmoid routing (scaled by routed_scaling_factor) moves a token whose groups score close to another
    group's experts, whose output differs by whole experts, not by rounding. Most tokens keep theirs."""
    name, hf, out, _, _ = family
    tokens = np.asarray(random_prompts(V3["vocab_size"])[1] * 3)
    _, exact_routes = routed_forward(load_model(open_checkpoint(out), progress=False), tokens)
    int8, routes = routed_forward(load_model(open_checkpoint(out), progress=False, numerics=Numerics(quantization="int8")), tokens)
    kept = (routes == exact_routes).all(axis=(1, 2))
    assert kept.mean() >= 0.75, kept
    with torch.no_grad():
        exact = hf(torch.tensor([tokens.tolist()])).logits[0].numpy()
    per_token = np.abs(int8 - exact).max(-1)[kept]
    print(f"deepseek {name} int8: {kept.sum()} of {len(tokens)} tokens routed as in float32; there, max |logit diff| per "
          f"token, median {np.median(per_token):.3f}, max {per_token.max():.3f} (logit std {exact.std():.2f})")  # -rP
    assert np.median(per_token) < 0.1 * exact.std() and per_token.max() < 0.5 * exact.std(), per_token
    assert (int8.argmax(-1) == exact.argmax(-1)).mean() >= 0.9


def test_the_cache_holds_one_latent_per_token_and_layer(family):
    """layers x (kv_lora_rank + qk_rope_head_dim) x 4 bytes (float32), what the worker reports."""
    _, _, _, engines, _ = family
    engine = engines["fused"]
    assert engine.cache.v is None and engine.cache.k.shape == (LAYERS, NUM_PAGES, PAGE_SIZE, 1, RANK + ROPE_DIM)
    assert engine.kv_bytes_per_token == LAYERS * (RANK + ROPE_DIM) * 4


@pytest.mark.parametrize("model, overrides, message", [
    ("DeepseekV3", dict(attention_bias=True), "with attention_bias true is not supported"),
    ("DeepseekV3", dict(hidden_act="gelu"), "with hidden_act 'gelu' is not supported"),
    ("DeepseekV3", dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
     "with rope_type 'linear' is not supported"),
    ("DeepseekV3", dict(moe_layer_freq=2), "with moe_layer_freq 2 is not supported"),
    ("DeepseekV2", dict(first_k_dense_replace=1, topk_method="noaux_tc"), "with topk_method 'noaux_tc' is not supported"),
    ("DeepseekV2", dict(first_k_dense_replace=1, norm_topk_prob=True), "with norm_topk_prob true is not supported"),
])
def test_a_config_asking_for_what_is_not_implemented_is_refused(tmp_path, model, overrides, message):
    numbers = V3 if model == "DeepseekV3" else V2
    config = {**numbers, "architectures": [f"{model}ForCausalLM"], "model_type": model.lower().replace("deepseek", "deepseek_"),
              **overrides}
    assert_refused(tmp_path, config, model, message)
