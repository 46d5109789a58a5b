"""Qwen3 (dense), small random configs: our worker against Hugging Face transformers' Qwen3ForCausalLM
(PyTorch, CPU, float32) on the same weights, saved by transformers as a safetensors directory and read
back by our loader. Prompts run together through the real scheduler core, so the logits compared come
from chunked prefill beside batched paged decode, not a plain forward.

    python -m pytest tests/model/test_qwen3_parity.py -rP    # also prints each prompt's largest difference
"""


import numpy as np
import pytest

from jaxstream import protocol
from tests.model.parity import BUCKETS, BUDGET, NEW_TOKENS, NUM_PAGES, PAGE_SIZE, PROMPT_LENGTHS, assert_refused, random_prompts, redraw
from tests.worker.driver import Driver
from worker_svc.engine import Engine
from worker_svc.loading import load_model, model_config
from worker_svc.weights import open_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# head_dim 32 is not hidden / heads (16); rope_theta and eps as released Qwen3 checkpoints have them.
CONFIG = dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=512)


def hf_qwen3(tied: bool):
    """transformers' Qwen3ForCausalLM, seeded, float32, eval mode. The default initializer (std 0.02, norms
    all ones) gives nearly flat logits and would leave the q/k norms untested, so the weights are redrawn
    larger and every norm gets its own scales."""
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG, tie_word_embeddings=tied))
    return redraw(model)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def case(request, tmp_path_factory):
    """(transformers model, our Engine loaded from its save_pretrained directory)."""
    tied = request.param
    hf = hf_qwen3(tied)
    out = tmp_path_factory.mktemp(f"qwen3_{'tied' if tied else 'untied'}")
    hf.save_pretrained(out)
    checkpoint = open_checkpoint(out)
    assert ("lm_head.weight" in checkpoint.names) is not tied
    _, cfg, _ = model_config(checkpoint)
    assert (cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.tie_embeddings, cfg.rope_theta) == (32, 4, 2, tied, 1e6)
    engine = Engine(load_model(checkpoint, progress=False), BUCKETS, PAGE_SIZE, NUM_PAGES)
    return hf, engine


def test_logits_match_transformers_and_greedy_tokens_are_identical(case):
    hf, engine = case
    prompts = random_prompts(CONFIG["vocab_size"])
    greedy = protocol.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    driver = Driver(engine, PAGE_SIZE, NUM_PAGES, budget=BUDGET, max_running=4, keep_logits=True)
    traces = driver.run([(f"p{i}", p, greedy) for i, p in enumerate(prompts)])
    assert any(len(s.seqs) > 1 and s.seqs[-1].num_tokens > 1 for s in driver.steps)  # prefill beside decode
    assert max(PROMPT_LENGTHS) > 2 * BUDGET  # a prompt over several steps

    for i, prompt in enumerate(prompts):
        ours = traces[f"p{i}"]
        assert len(ours.tokens) == NEW_TOKENS
        with torch.no_grad():
            hf_logits = hf(torch.tensor([prompt + ours.tokens])).logits[0, len(prompt) - 1 : -1].numpy()  # [new tokens, V]
            hf_tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt) :]
        diff = np.abs(np.stack(ours.logits) - hf_logits).max()
        spread = hf_logits.std()
        print(f"prompt {i}: {len(prompt)} prompt tokens, max |logit diff| over {NEW_TOKENS} steps = {diff:.2e} (logit std {spread:.2f})")  # -rP
        assert diff <= 1e-3, f"prompt {i}: max abs logit difference {diff}"
        assert hf_tokens.tolist() == ours.tokens, f"prompt {i}"


@pytest.mark.parametrize("key, value, message", [
    ("attention_bias", True, "attention_bias true is not supported"),
    ("use_sliding_window", True, "sliding-window attention"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}, "rope_type 'yarn' is not supported"),
])
def test_a_config_asking_for_what_is_not_implemented_is_refused(tmp_path, key, value, message):
    assert_refused(tmp_path, {**CONFIG, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", key: value}, "Qwen3 ", message)


def test_a_qwen3_gguf_loads_the_model_transformers_loads(tmp_path):
    """The GGUF path: gguf_file.py's qwen3 names (attn_q_norm, ...) reach our model as transformers
    reads the same file (head_dim 128 over 2 heads of a 64-wide model; untied; Q8_0 embedding)."""
    from tests.model.test_weights import write_tiny_qwen3

    write_tiny_qwen3(tmp_path / "tiny.gguf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    engine = Engine(load_model(open_checkpoint(tmp_path / "tiny.gguf"), progress=False), BUCKETS, PAGE_SIZE, NUM_PAGES)
    prompt = list(range(3, 40))
    greedy = protocol.SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    ours = Driver(engine, PAGE_SIZE, NUM_PAGES, BUDGET, 4, keep_logits=True).run([("x", prompt, greedy)])["x"]
    with torch.no_grad():
        hf_logits = hf(torch.tensor([prompt + ours.tokens])).logits[0, len(prompt) - 1 : -1].numpy()
    diff = np.abs(np.stack(ours.logits) - hf_logits).max()
    print(f"GGUF: max |logit diff| over 8 steps = {diff:.2e} (logit std {hf_logits.std():.2f})")  # -rP
    assert diff <= 1e-3
    assert hf_logits.argmax(-1).tolist() == ours.tokens
