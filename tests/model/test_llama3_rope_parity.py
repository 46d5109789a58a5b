"""Llama 3.1's rotary scaling (rope_type `llama3`), small random config: our worker against Hugging Face
transformers' LlamaForCausalLM (PyTorch, CPU, float32) on the same weights, saved by transformers as a
safetensors directory and read back by our loader. original_max_position_embeddings is 32 and the
prompts reach position 82, and head_dim 16 over rope_theta 1e4 puts rotation frequencies in all three
of llama3's bands (kept, smoothed, divided by the factor), so the scaling shows in every logit.

    python -m pytest tests/model/test_llama3_rope_parity.py -rP    # also prints each prompt's largest difference
"""

import json

import numpy as np
import pytest

from jaxstream import protocol
from tests.model.parity import BUDGET, NUM_PAGES, PAGE_SIZE, assert_refused, random_prompts, redraw
from tests.worker.driver import Driver
from worker_svc.batch import Buckets
from worker_svc.engine import Engine
from worker_svc.layers.rotary import Llama3Scaling
from worker_svc.loading import load_model, model_config
from worker_svc.weights import open_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# parity.py's prompts, budget and pages; one token bucket and two pair buckets (prefill without context,
# anything with), so that two compiled forwards rather than six cover every step: the test is the rotary.
BUCKETS = Buckets(tokens=(BUDGET,), pairs=(0, 256), max_rows=4, max_pages=16)
NEW_TOKENS = 8  # the 75-token prompt already reaches past original_max_position_embeddings (32)
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}
CONFIG = dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=512, tie_word_embeddings=False)


def hf_llama(rope: dict | None):
    """transformers' LlamaForCausalLM, seeded (so the same weights whatever the rotary), redrawn, float32, eval mode."""
    torch.manual_seed(0)
    scaling = {} if rope is None else {"rope_scaling": rope}
    return redraw(transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, **scaling)))


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(transformers model, our Engine loaded from its save_pretrained directory)."""
    hf = hf_llama(ROPE)
    out = tmp_path_factory.mktemp("llama3_rope")
    hf.save_pretrained(out)  # transformers 5 writes the scaling inside rope_parameters
    _, cfg, _ = model_config(open_checkpoint(out))
    assert cfg.rope_scaling == Llama3Scaling(8.0, 1.0, 4.0, 32)
    return hf, Engine(load_model(open_checkpoint(out), progress=False), BUCKETS, PAGE_SIZE, NUM_PAGES), out


def test_logits_match_transformers_and_greedy_tokens_are_identical(case):
    hf, engine, _ = case
    prompts = random_prompts(CONFIG["vocab_size"])
    greedy = protocol.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    traces = Driver(engine, PAGE_SIZE, NUM_PAGES, budget=BUDGET, max_running=4, keep_logits=True).run(
        [(f"p{i}", p, greedy) for i, p in enumerate(prompts)])
    unscaled = hf_llama(None)  # the same weights with plain rotary: what ignoring rope_scaling would serve
    for i, prompt in enumerate(prompts):
        ours = traces[f"p{i}"]
        seq = torch.tensor([prompt + ours.tokens])
        with torch.no_grad():
            hf_logits = hf(seq).logits[0, len(prompt) - 1 : -1].numpy()  # [new tokens, V]
            plain_logits = unscaled(seq).logits[0, len(prompt) - 1 : -1].numpy()
            hf_tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt) :]
        diff = np.abs(np.stack(ours.logits) - hf_logits).max()
        scaling_matters = np.abs(plain_logits - hf_logits).max()
        print(f"prompt {i}: {len(prompt)} prompt tokens, max |logit diff| = {diff:.2e}; "
              f"without the scaling it would be {scaling_matters:.2e}")  # -rP
        assert diff <= 1e-3, f"prompt {i}: max abs logit difference {diff}"
        assert scaling_matters > 0.1, f"prompt {i}: the scaling barely changes the logits ({scaling_matters}), so this test could not see it"
        assert hf_tokens.tolist() == ours.tokens, f"prompt {i}"


def test_a_released_config_json_names_the_same_scaling(case, tmp_path):
    """Released Llama 3.1 directories (written by transformers 4) say `rope_scaling` and `rope_theta`
    at the top level, not transformers 5's `rope_parameters`: both read the same."""
    _, _, saved = case
    config = json.loads((saved / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config |= {"rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(saved / "model.safetensors")
    checkpoint = open_checkpoint(tmp_path)
    _, cfg, _ = model_config(checkpoint)
    assert cfg.rope_scaling == Llama3Scaling(8.0, 1.0, 4.0, 32) and cfg.rope_theta == 1e4


@pytest.mark.parametrize("key, value, message", [
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}, "rope_type 'linear' is not supported"),
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "rope_type 'dynamic' is not supported"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, "rope_type 'yarn' is not supported"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "lacks ['low_freq_factor', 'high_freq_factor', "
                                                              "'original_max_position_embeddings']"),
    ("attention_bias", True, "attention_bias true is not supported"),
    ("mlp_bias", True, "mlp_bias true is not supported"),
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
])
def test_a_config_asking_for_what_is_not_implemented_is_refused(tmp_path, key, value, message):
    assert_refused(tmp_path, {**CONFIG, "architectures": ["LlamaForCausalLM"], "model_type": "llama", key: value}, "Llama with ", message)
