"""Qwen3-MoE, small random configs: our worker, with each MoE strategy (`fused` and `ep`), against Hugging
Face transformers' Qwen3MoeForCausalLM (PyTorch, CPU, float32) on the same weights, saved by transformers
as a safetensors directory and read back by our loader. As in test_qwen3_parity.py, prompts run together
through the real scheduler core: chunked prefill beside batched paged decode.

    python -m pytest tests/model/test_qwen3_moe_parity.py -rP    # also prints the largest differences
"""

import json
import re

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxstream import protocol
from tests.model.parity import BUCKETS, BUDGET, NEW_TOKENS, NUM_PAGES, PAGE_SIZE, PROMPT_LENGTHS, random_prompts, redraw
from tests.worker.driver import Driver
from worker_svc.engine import Engine
from worker_svc.loading import load_model, model_config
from worker_svc.weights import CheckpointError, open_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=512,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
CASES = {  # id -> config overrides, and the layers that must come out MoE
    "moe_normed": (dict(norm_topk_prob=True), (0, 1, 2)),
    "dense_layer_1_unnormed": (dict(norm_topk_prob=False, mlp_only_layers=[1]), (0, 2)),
}


def hf_qwen3_moe(overrides: dict):
    """transformers' model, seeded, float32, eval mode, weights redrawn so that logits and the router's
    choices are not flat: each matrix ~ N(0, 1/fan_in) (experts included: their last axis is the input),
    the embedding N(0, 1), every norm its own scales."""
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**CONFIG, **overrides))
    return redraw(model)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(transformers model, {strategy: our Engine loaded from its save_pretrained directory})."""
    overrides, moe_layers = CASES[request.param]
    hf = hf_qwen3_moe(overrides)
    assert [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")] == list(moe_layers)
    out = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(out)
    checkpoint = open_checkpoint(out)
    engines = {}
    for strategy in ("fused", "ep"):
        model = load_model(checkpoint, progress=False, moe=strategy)
        assert (model.cfg.moe, model.cfg.moe_layers, model.cfg.experts, model.cfg.top_k) == (strategy, moe_layers, 8, 2)
        engines[strategy] = Engine(model, BUCKETS, PAGE_SIZE, NUM_PAGES)
    return hf, engines


def test_logits_match_transformers_and_greedy_tokens_are_identical_for_both_strategies(case):
    hf, engines = case
    prompts = random_prompts(CONFIG["vocab_size"])
    greedy = protocol.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    traces = {}
    for strategy, engine in engines.items():
        driver = Driver(engine, PAGE_SIZE, NUM_PAGES, budget=BUDGET, max_running=4, keep_logits=True)
        traces[strategy] = driver.run([(f"p{i}", p, greedy) for i, p in enumerate(prompts)])
        assert any(len(s.seqs) > 1 and s.seqs[-1].num_tokens > 1 for s in driver.steps)  # prefill beside decode
    assert max(PROMPT_LENGTHS) > 2 * BUDGET  # a prompt over several steps

    for i, prompt in enumerate(prompts):
        fused, ep = traces["fused"][f"p{i}"], traces["ep"][f"p{i}"]
        with torch.no_grad():
            hf_tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()
            hf_logits = hf(torch.tensor([prompt + hf_tokens])).logits[0, len(prompt) - 1 : -1].numpy()  # [new tokens, V]
        between = np.abs(np.stack(fused.logits) - np.stack(ep.logits)).max()
        line = f"prompt {i}: {len(prompt)} prompt tokens, max |logit diff| over {NEW_TOKENS} steps:"
        for strategy, ours in (("fused", fused), ("ep", ep)):
            assert ours.tokens == hf_tokens, f"prompt {i}, {strategy}"
            diff = np.abs(np.stack(ours.logits) - hf_logits).max()
            line += f" {strategy} vs transformers {diff:.2e},"
            assert diff <= 1e-3, f"prompt {i}, {strategy}: max abs logit difference {diff}"
        print(f"{line} fused vs ep {between:.2e} (logit std {hf_logits.std():.2f})")  # -rP
        assert between <= 1e-5, f"prompt {i}: fused and ep differ by {between}"


def test_which_layers_are_moe_follows_transformers(tmp_path):
    """decoder_sparse_step and mlp_only_layers together, read by transformers' own decoder layers."""
    config = transformers.Qwen3MoeConfig(**{**CONFIG, "num_hidden_layers": 6}, decoder_sparse_step=2, mlp_only_layers=[3])
    hf = transformers.Qwen3MoeForCausalLM(config)
    hf.save_pretrained(tmp_path)
    _, cfg, _ = model_config(open_checkpoint(tmp_path))
    assert cfg.moe_layers == tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")) == (1, 5)


@pytest.mark.parametrize("key, value, message", [
    ("hidden_act", "gelu", "Qwen3-MoE with hidden_act 'gelu' is not supported"),
    ("decoder_sparse_step", 0, "Qwen3-MoE with decoder_sparse_step 0 is not supported"),
    ("attention_bias", True, "Qwen3 with attention_bias true is not supported"),
    ("use_sliding_window", True, "Qwen3 with sliding-window attention"),
])
def test_a_config_asking_for_what_is_not_implemented_is_refused(tmp_path, key, value, message):
    config = {**CONFIG, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", key: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": np.zeros((2, 2), np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path}: {message}")):
        load_model(open_checkpoint(tmp_path), progress=False)
