"""Qwen2 (Qwen2.5), Mistral and Mixtral, small random configs: our worker against Hugging Face
transformers' own model class (PyTorch, CPU, float32) on the same weights, saved by transformers as a
safetensors directory and read back by our loader. As in test_qwen3_parity.py, prompts run together
through the real scheduler core (chunked prefill beside batched paged decode), and then one more
request whose first pages are a prefix-cache hit; Mixtral under both MoE strategies, its routed
experts as transformers' router picks them; each with int8 weights.

    python -m pytest tests/model/test_families.py -rP    # also prints each family's largest difference
"""

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxstream import protocol
from jaxstream.architectures import SERVED
from tests.model.parity import (BUCKETS, BUDGET, NEW_TOKENS, NUM_PAGES, PAGE_SIZE, PROMPT_LENGTHS, assert_refused,
                                   random_prompts, redraw, assert_int8_follows, assert_routed_experts_are_transformers,
                                   assert_weights_read_back)
from tests.worker.driver import Driver
from worker_svc.engine import Engine
from worker_svc.layers.numerics import Numerics
from worker_svc.loading import load_model, model_config
from worker_svc.models import ARCHITECTURES
from worker_svc.weights import open_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4  # max |logit difference|, float32
NUMBERS = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=512)
FAMILIES = {  # id -> (transformers class name, config overrides, MoE strategies served)
    # Tied, as Qwen2.5's small models; biases on q, k and v; layer 1 slides by 8 (max_window_layers), layer 0 does not.
    "qwen2": ("Qwen2", dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=8, max_window_layers=1), ("fused",)),
    # Untied; its own head_dim (32, not hidden / heads); every layer slides by 12, fewer than the prompts and decodes.
    "mistral": ("Mistral", dict(tie_word_embeddings=False, head_dim=32, sliding_window=12), ("fused",)),
    "mixtral": ("Mixtral", dict(tie_word_embeddings=False, intermediate_size=32, sliding_window=None, num_local_experts=8,
                                num_experts_per_tok=2), ("fused", "ep")),
}
GREEDY = protocol.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def hf_model(family: str):
    name, overrides, _ = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, f"{name}Config")(**{**NUMBERS, **overrides})
    return redraw(getattr(transformers, f"{name}ForCausalLM")(config))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, transformers model, its saved directory, {MoE strategy: our Engine loaded from it})."""
    hf = hf_model(request.param)
    out = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(out)
    checkpoint = open_checkpoint(out)
    engines = {strategy: Engine(load_model(checkpoint, progress=False, moe=strategy), BUCKETS, PAGE_SIZE, NUM_PAGES, routed_experts=True)
               for strategy in FAMILIES[request.param][2]}
    return request.param, hf, out, engines


def hf_greedy(hf, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens after `prompt` and its logits [NEW_TOKENS, V] before each."""
    with torch.no_grad():
        tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].numpy()
    return tokens, logits


def test_logits_match_transformers_through_chunked_prefill_decode_and_a_prefix_cache_hit(family):
    name, hf, _, engines = family
    prompts = random_prompts(NUMBERS["vocab_size"])
    # A fourth request after the others: the first 48 tokens of the long prompt (6 whole pages, cached), then its own.
    hit = prompts[0][:48] + np.random.default_rng(1).integers(0, NUMBERS["vocab_size"], 9).tolist()
    requests = [(f"p{i}", p) for i, p in enumerate(prompts)] + [("hit", hit)]
    expected = {rid: hf_greedy(hf, prompt) for rid, prompt in requests}  # (tokens, logits), whichever strategy serves
    worst = {}
    for strategy, engine in engines.items():
        driver = Driver(engine, PAGE_SIZE, NUM_PAGES, budget=BUDGET, max_running=4, keep_logits=True, prefix_cache=True)
        traces = driver.run([(rid, prompt, GREEDY) for rid, prompt in requests[:-1]])
        assert any(len(s.seqs) > 1 and s.seqs[-1].num_tokens > 1 for s in driver.steps)  # prefill beside decode
        traces |= driver.run([("hit", hit, GREEDY)])
        first = next(s.seqs[0] for s in driver.steps if s.seqs[0].rid == "hit")
        assert first.context_len - first.num_tokens >= 6 * PAGE_SIZE  # fed after a cache hit of whole pages
        for rid, (tokens, logits) in expected.items():
            assert traces[rid].tokens == tokens, f"{name} {strategy} {rid}"
            worst[strategy, rid] = np.abs(np.stack(traces[rid].logits) - logits).max()
    each = ", ".join(f"{strategy} {max(d for (s, _), d in worst.items() if s == strategy):.2e}" for strategy in engines)
    print(f"{name}: max |logit diff| over prompts of {PROMPT_LENGTHS} and a cache hit, {NEW_TOKENS} steps each: "
          f"{each} (logit std {expected['p0'][1].std():.2f})")  # -rP
    assert max(worst.values()) <= TOLERANCE, worst


def test_the_weights_read_back_by_hugging_face_name_are_the_checkpoints(family):
    _, _, out, engines = family
    assert_weights_read_back(next(iter(engines.values())), out)


def test_routed_experts_are_the_ones_transformers_router_picks_and_a_dense_family_has_none(family):
    name, hf, _, engines = family
    if name != "mixtral":  # the switch on (the fixture's engines), no MoE layer: nothing captured, none reported
        assert all(engine.experts is None and engine.facts.moe_layers == 0 for engine in engines.values())
        return
    assert_routed_experts_are_transformers(hf, engines, "gate", NUMBERS["vocab_size"], top_k=2)


def test_int8_weights_give_transformers_logits_within_quantization_error(family):
    """worker.quantization=int8 from the checkpoint's tensors (Mixtral's experts per expert and output
    channel; Qwen2's biases stay float), one prefill forward."""
    name, hf, out, _ = family
    tokens = np.asarray(random_prompts(NUMBERS["vocab_size"])[1] * 2)
    assert_int8_follows(name, hf, load_model(open_checkpoint(out), progress=False, numerics=Numerics(quantization="int8")), tokens)


def test_every_served_architecture_is_registered_and_preflight_knows_each():
    assert set(SERVED) == set(ARCHITECTURES)


@pytest.mark.parametrize("family, overrides, message", [
    ("Mistral", dict(sliding_window=None, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}),
     "with rope_type 'yarn' is not supported"),
    ("Qwen2", dict(hidden_act="gelu"), "with hidden_act 'gelu' is not supported"),
])
def test_a_config_asking_for_what_is_not_implemented_is_refused(tmp_path, family, overrides, message):
    config = {**NUMBERS, "architectures": [f"{family}ForCausalLM"], "model_type": family.lower(), **overrides}
    assert_refused(tmp_path, config, family, message)


@pytest.mark.parametrize("family, overrides", [
    ("Qwen2", dict(use_sliding_window=False, sliding_window=16)),  # transformers ignores the window without the switch
    ("Qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)),  # no layer from 2 on: none slides
    ("Mistral", dict(sliding_window=None)),
    ("Mixtral", dict(sliding_window=512, num_local_experts=4, num_experts_per_tok=2)),  # not smaller than the context
])
def test_a_window_that_does_not_slide_is_served(tmp_path, family, overrides):
    """What transformers reads as full attention on every layer, its own config class deciding."""
    config = getattr(transformers, f"{family}Config")(**NUMBERS, **overrides)
    config.architectures = [f"{family}ForCausalLM"]
    config.save_pretrained(tmp_path)
    save_file({"model.embed_tokens.weight": np.zeros((2, 2), np.float32)}, str(tmp_path / "model.safetensors"))  # never read
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    window = config.sliding_window
    assert window is None or window >= NUMBERS["max_position_embeddings"] or set(layer_types) == {"full_attention"}
    _, cfg, _ = model_config(open_checkpoint(tmp_path))
    assert cfg.layers == 2
