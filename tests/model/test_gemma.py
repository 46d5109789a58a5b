"""Gemma 2 and Gemma 3 (text), small random configs: our worker against Hugging Face transformers'
own model class (PyTorch, CPU, float32) on the same weights, saved by transformers as a safetensors
directory and read back by our loader, as test_families.py does for Qwen2, Mistral and Mixtral:
prompts through the real scheduler core (chunked prefill beside batched paged decode), then one
more request whose first pages are a prefix-cache hit; and with int8 weights. Each config exercises
what Gemma adds: a local layer whose window (12) is shorter than the prompts, a global one, the
query scale of query_pre_attn_scalar (not head_dim), soft-capped logits; Gemma 2 soft-caps its
attention scores too, Gemma 3 normalizes q and k and rotates its global layer by another base,
linearly scaled (as gemma-3-4b's), and has an untied head. tp2: tests/worker/tp_check.py.

    python -m pytest tests/model/test_gemma.py -rP    # also prints each family's largest difference
"""

import copy
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxstream import protocol
from jaxstream.config import load_config
from tests.model.parity import (BUCKETS, BUDGET, NEW_TOKENS, NUM_PAGES, PAGE_SIZE, PROMPT_LENGTHS, assert_refused,
                                   random_prompts, redraw, assert_int8_follows, assert_weights_read_back)
from tests.model.test_families import GREEDY, TOLERANCE, hf_greedy
from tests.model.test_model_configs import TINY
from tests.worker.driver import Driver
from worker_svc.engine import Engine
from worker_svc.layers.attention import KVCache, PagedContext
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.rotary import LinearScaling
from worker_svc.loading import check_hf_config, load_model, model_config, open_model
from worker_svc.models.gemma3 import Gemma3Config
from worker_svc.start import build_engine
from worker_svc.weights import Checkpoint, open_checkpoint
from worker_svc.weights.hf_dir import with_implicit_keys

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WINDOW = 12  # shorter than the 75-, 19- and 57-token prompts, and not a whole number of pages
NUMBERS = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, rms_norm_eps=1e-6, max_position_embeddings=512,
               sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
TWO = protocol.SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
FAMILIES = {  # id -> (transformers' config class, its model class, config overrides)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(attn_logit_softcapping=5.0, final_logit_softcapping=30.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        final_logit_softcapping=4.0, tie_word_embeddings=False,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})),
}


def hf_model(family: str):
    config_name, model_name, overrides = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**copy.deepcopy({**NUMBERS, **overrides}))
    config._attn_implementation = "eager"  # the soft-capping path (transformers' sdpa drops Gemma 2's)
    return redraw(getattr(transformers, model_name)(config))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, transformers model, its saved directory, our Engine loaded from it)."""
    hf = hf_model(request.param)
    out = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(out)
    engine = Engine(load_model(open_checkpoint(out), progress=False), BUCKETS, PAGE_SIZE, NUM_PAGES)
    return request.param, hf, out, engine


def test_logits_match_transformers_through_chunked_prefill_decode_and_a_prefix_cache_hit(family):
    name, hf, _, engine = family
    prompts = random_prompts(NUMBERS["vocab_size"])
    hit = prompts[0][:48] + np.random.default_rng(1).integers(0, NUMBERS["vocab_size"], 9).tolist()
    requests = [(f"p{i}", p) for i, p in enumerate(prompts)]
    expected = {rid: hf_greedy(hf, prompt) for rid, prompt in requests + [("hit", hit)]}  # (tokens, logits)
    driver = Driver(engine, PAGE_SIZE, NUM_PAGES, budget=BUDGET, max_running=4, keep_logits=True, prefix_cache=True)
    traces = driver.run([(rid, prompt, GREEDY) for rid, prompt in requests])
    assert any(len(s.seqs) > 1 and s.seqs[-1].num_tokens > 1 for s in driver.steps)  # prefill beside decode
    traces |= driver.run([("hit", hit, GREEDY)])
    first = next(s.seqs[0] for s in driver.steps if s.seqs[0].rid == "hit")
    assert first.context_len - first.num_tokens >= 6 * PAGE_SIZE  # fed after a cache hit of whole pages
    worst = {}
    for rid, (tokens, logits) in expected.items():
        assert traces[rid].tokens == tokens, f"{name} {rid}"
        worst[rid] = np.abs(np.stack(traces[rid].logits) - logits).max()
    print(f"{name}: max |logit diff| over prompts of {PROMPT_LENGTHS} and a cache hit, {NEW_TOKENS} steps each: "
          f"{max(worst.values()):.2e} (logit std {expected['p0'][1].std():.2f})")  # -rP
    assert max(worst.values()) <= TOLERANCE, worst


def test_the_weights_read_back_by_hugging_face_name_are_the_checkpoints(family):
    """Every norm's w as stored (the norm adds 1)."""
    _, _, out, engine = family
    assert_weights_read_back(engine, out)


def test_int8_weights_give_transformers_logits_within_quantization_error(family):
    """worker.quantization=int8 from the checkpoint's tensors, one prefill forward (longer than the window)."""
    name, hf, out, _ = family
    tokens = np.asarray(random_prompts(NUMBERS["vocab_size"])[1] * 4)
    assert_int8_follows(name, hf, load_model(open_checkpoint(out), progress=False, numerics=Numerics(quantization="int8")), tokens)


def test_batch_invariant_attention_over_a_whole_sequence_gives_transformers_logits(family):
    """worker.batch_invariant's ordered attention, the window and soft-cap included, over one whole
    sequence as a trainer runs the served layers (PagedContext.sequence: every key this step's)."""
    name, hf, out, _ = family
    model = load_model(open_checkpoint(out), progress=False, numerics=Numerics(batch_invariant=True))
    tokens, cfg = random_prompts(NUMBERS["vocab_size"])[0], model.cfg
    ctx = jax.tree.map(jnp.asarray, PagedContext.sequence(len(tokens), PAGE_SIZE))
    empty = jnp.zeros((cfg.layers, 1, PAGE_SIZE, cfg.kv_heads, cfg.head_dim))
    ours = nnx.jit(lambda m, t: m(t, ctx, KVCache(empty, empty), jnp.arange(len(tokens)))[0])(model, jnp.asarray(tokens))
    with torch.no_grad():
        theirs = hf(torch.tensor([tokens])).logits[0].numpy()
    diff = np.abs(np.asarray(ours) - theirs).max()
    print(f"{name} batch_invariant, one {len(tokens)}-token sequence: max |logit diff| {diff:.2e}")  # -rP
    assert diff <= TOLERANCE


def test_a_gemma3_config_as_released_reads_as_transformers_5_writes_it():
    """Released Gemma 3 configs (transformers 4) give the global layers' rotary as rope_theta and
    rope_scaling, the local layers' base as rope_local_base_freq, and the layer pattern as
    sliding_window_pattern; transformers 5 writes rope_parameters per kind and layer_types."""
    released = {**NUMBERS, "num_hidden_layers": 7, "layer_types": None, "sliding_window_pattern": 3, "rope_theta": 1e6,
                "rope_local_base_freq": 5e4, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    ours = Gemma3Config.from_hf({k: v for k, v in released.items() if v is not None})
    written = Gemma3Config.from_hf(with_implicit_keys(transformers.Gemma3TextConfig(**copy.deepcopy(released)).to_dict()))
    assert ours == written
    assert ours.windows == (WINDOW, WINDOW, 0, WINDOW, WINDOW, 0, WINDOW)
    assert (ours.rope_theta, ours.rope_scaling, ours.local_rope_theta, ours.local_rope_scaling) == (1e6, LinearScaling(4.0), 5e4, None)


@pytest.mark.parametrize("family, overrides, message", [
    ("Gemma2", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "with rope_type 'linear' is not supported"),
    ("Gemma2", dict(hidden_activation="gelu"), "with hidden_activation 'gelu' is not supported"),
    ("Gemma3", dict(attn_logit_softcapping=50.0), "with attn_logit_softcapping set is not supported"),
    ("Gemma3", dict(use_bidirectional_attention=True), "with use_bidirectional_attention true is not supported"),
    ("Gemma3", dict(layer_types=["chunked_attention", "full_attention"]), "with layer_types ['chunked_attention'] is not supported"),
    ("Gemma3", dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 8.0}}),
     "with rope_type 'yarn' on its full_attention layers is not supported"),
])
def test_a_config_asking_for_what_is_not_implemented_is_refused(tmp_path, family, overrides, message):
    config = {**NUMBERS, "architectures": [f"{family}ForCausalLM"], **overrides}
    assert_refused(tmp_path, config, family, message)


@pytest.mark.parametrize("name", ["gemma2_tiny", "gemma3_tiny"])
def test_a_tiny_config_is_served_by_the_worker_from_its_numbers_alone(name):
    """The worker's own start-up (build_engine: its numerics, the CPU kernels attending with the
    window and soft-cap), random weights from model.hf_config, prompts longer than the window."""
    cfg = load_config([f"model={name}", *TINY, "model.hf_config.sliding_window=6"])
    engine = build_engine(cfg, progress=False)
    assert engine.facts.model_type == cfg.model.hf_config["model_type"] and engine.vocab == 49152
    traces = Driver(engine, cfg.scheduler.page_size, cfg.scheduler.num_pages, budget=8, max_running=2, keep_logits=True).run(
        [("a", list(range(1, 20)), TWO), ("b", [5, 6, 7], TWO)])
    assert all(len(t.tokens) == 2 and np.isfinite(np.stack(t.logits)).all() for t in traces.values())


# The released models' parameter counts: transformers' own model of the same numbers (built on the
# meta device: no memory), so the worker reads every tensor the checkpoint holds and no other.
RELEASED = {"gemma2_9b_it": "Gemma2ForCausalLM", "gemma3_4b_it": "Gemma3ForCausalLM"}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_a_released_config_builds_transformers_model_at_full_size(name):
    given = load_config([f"model={name}", "model.path=null"]).model.hf_config
    model_cls, cfg, _ = model_config(open_model(load_config([f"model={name}", "model.path=null"]).model, dummy=True))
    abstract = nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(0)))
    ours = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    saved = transformers.AutoConfig.for_model(**copy.deepcopy({k: v for k, v in given.items() if k != "architectures"}))
    with torch.device("meta"):
        theirs = sum(p.numel() for p in getattr(transformers, RELEASED[name])(saved).parameters())
    print(f"{name}: {ours:,} parameters ({ours / 1e9:.3f}B)")  # -rP
    assert ours == theirs
    # The numbers as transformers 5 saves them to config.json satisfy the config, key by key.
    saved.architectures = given["architectures"]
    check_hf_config(given, Checkpoint(Path("config.json saved by transformers"), with_implicit_keys(saved.to_dict()), (), lambda n: None))


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_a_config_without_head_dim_gets_transformers_default_not_hidden_over_heads(model_type):
    """transformers' Gemma 2 and 3 default head_dim is 256, whatever hidden_size / heads is (2304 / 8 = 288)."""
    read = with_implicit_keys({"model_type": model_type, "hidden_size": 2304, "num_attention_heads": 8})
    assert read["head_dim"] == getattr(transformers, {"gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig"}[model_type])().head_dim == 256
