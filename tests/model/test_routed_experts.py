"""Routed experts export (worker.enable_return_routed_experts): the experts our worker reports for
every position a request ran are the ones Hugging Face transformers' Qwen3-MoE router picks (PyTorch,
CPU, float32, same weights) for the same tokens, in the router's order; a dense layer's rows are 0
(SGLang's rule). A prompt over several steps beside others, and a prefix-cache hit. One MoE strategy
(`ep`): the router, whose choices are captured, is the same for both (test_qwen3_moe_parity.py).

    python -m pytest tests/model/test_routed_experts.py
"""

import msgspec
import numpy as np
import pytest

from gateway.experts import routed_layout
from jaxstream import protocol
from jaxstream.arrays import from_wire
from tests.model.parity import BUCKETS, BUDGET, NUM_PAGES, PAGE_SIZE, random_prompts, redraw
from tests.worker.driver import Driver
from worker_svc.engine import Engine
from worker_svc.loading import load_model
from worker_svc.weights import open_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=512,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])
MOE_LAYERS, DENSE_LAYER = (0, 2), 1
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers model, our Engine with routed experts on, from its saved directory)."""
    torch.manual_seed(0)
    hf = redraw(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**CONFIG)))
    out = tmp_path_factory.mktemp("qwen3_moe_routed")
    hf.save_pretrained(out)
    checkpoint = open_checkpoint(out)
    return hf, Engine(load_model(checkpoint, progress=False, moe="ep"), BUCKETS, PAGE_SIZE, NUM_PAGES, routed_experts=True)


def hf_routed(hf, tokens: list[int]) -> np.ndarray:
    """[len(tokens), L, k]: the experts each layer's router picked for each token (0 in dense layers)."""
    picked = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out, at=at: picked.__setitem__(at, out[2][0] if out[2].dim() == 3 else out[2]))
             for at, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    try:
        with torch.no_grad():
            hf(torch.tensor([tokens]))
    finally:
        for hook in hooks:
            hook.remove()
    rows = np.zeros((len(tokens), CONFIG["num_hidden_layers"], CONFIG["num_experts_per_tok"]), np.int32)
    for at, ids in picked.items():
        rows[:, at] = ids.numpy()
    return rows


def gathered(trace) -> tuple[int, np.ndarray]:
    """A request's RoutedExperts put together: (first position, rows [n, L, k])."""
    parts = sorted(((e.first, from_wire(e.ids)) for e in trace.experts), key=lambda p: p[0])
    assert all(a + len(x) == b for (a, x), (b, _) in zip(parts, parts[1:])), "rows not contiguous"
    return parts[0][0], np.concatenate([x for _, x in parts])


def test_routed_experts_are_the_ones_transformers_picks(models):
    hf, engine = models
    prompts = random_prompts(CONFIG["vocab_size"])  # 75 tokens over three steps, beside two short ones
    asks = protocol.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    plain = protocol.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    driver = Driver(engine, PAGE_SIZE, NUM_PAGES, budget=BUDGET, max_running=4)
    traces = driver.run([(f"p{i}", p, asks if i != 1 else plain) for i, p in enumerate(prompts)])
    assert any(len(s.seqs) > 1 and s.seqs[-1].num_tokens > 1 for s in driver.steps)  # prefill beside decode
    assert traces["p1"].experts == []  # it did not ask: nothing read back for it
    # What the gateway reads of the worker's facts (as they travel with the heartbeat): a MoE model, the switch on
    assert routed_layout(protocol.decoder(protocol.ModelFacts).decode(protocol.encode(engine.facts))) == (3, 2)
    for i in (0, 2):
        prompt, tokens = prompts[i], traces[f"p{i}"].tokens
        first, ours = gathered(traces[f"p{i}"])
        # Every position that ran, the last sampled token's excepted (it never ran); with overlap
        # off, the driver's steps stop at the request's last token.
        assert first == 0 and ours.shape == (len(prompt) + NEW_TOKENS - 1, 3, 2), i
        theirs = hf_routed(hf, prompt + tokens[:-1])
        np.testing.assert_array_equal(ours, theirs, err_msg=f"prompt {i}")
        assert not ours[:, DENSE_LAYER].any() and ours[:, list(MOE_LAYERS)].any()


def test_a_prefix_cache_hit_reports_the_cached_rows_from_the_start_len_on(models):
    hf, engine = models
    prompt = random_prompts(CONFIG["vocab_size"])[0][:40]
    driver = Driver(engine, PAGE_SIZE, NUM_PAGES, budget=16, max_running=4, prefix_cache=True)
    asks = protocol.SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    first = driver.run([("a", prompt, asks)])["a"]
    later = msgspec.structs.replace(asks, routed_experts_start_len=5)
    second = driver.run([("b", prompt, later)])["b"]
    b_first_seq = next(s.seqs[0] for s in driver.steps if s.seqs[0].rid == "b")
    assert b_first_seq.context_len - b_first_seq.num_tokens >= 2 * PAGE_SIZE  # fed after a cache hit of whole pages
    a_first, a_rows = gathered(first)
    b_first, b_rows = gathered(second)
    assert (a_first, b_first) == (0, 5) and second.tokens == first.tokens
    np.testing.assert_array_equal(b_rows, a_rows[5:])
    np.testing.assert_array_equal(a_rows, hf_routed(hf, prompt + first.tokens[:-1]))
