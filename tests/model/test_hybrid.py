"""Qwen3.5 (dense), Qwen3.5-MoE and Qwen3-Next, hybrids of Gated DeltaNet linear-attention layers
and gated full-attention layers: each a small random checkpoint made by transformers (weights
redrawn; three linear layers and one full, as released) against transformers' own model in
float32, through the real scheduler core (tests/worker/driver.py): a 75-token prompt prefilled in
three chunks beside the others' decode, so each linear layer carries its recurrent and convolution states from chunk to chunk and across decode
steps, per request slot. With the prefix cache on, a hit starts the linear layers from the state
snapshot kept where the hit ends (scheduler_svc/snapshots.py) and gives the tokens and logits of a miss.

    python -m pytest tests/model/test_hybrid.py -rP    # also prints the largest difference
"""

import numpy as np
import pytest

from jaxstream import protocol
from tests.model.parity import (BUCKETS, BUDGET, NEW_TOKENS, NUM_PAGES, PAGE_SIZE, PROMPT_LENGTHS, assert_weights_read_back,
                                random_prompts, redraw)
from tests.model.test_families import hf_greedy  # by one forward over the whole sequence (its chunked delta rule)
from tests.worker.driver import Driver
from worker_svc.engine import Engine
from worker_svc.loading import load_model
from worker_svc.weights import open_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4  # max |logit difference|, float32
NUMBERS = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
               linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
               linear_conv_kernel_dim=4, rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.5))
EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
FAMILIES = {  # id -> (transformers' name stem, config overrides)
    "qwen3_5": ("Qwen3_5", {}),
    "qwen3_5_moe": ("Qwen3_5Moe", EXPERTS),
    # fused input projections; layer 1 dense (mlp_only_layers), the others MoE without renormalized top-k
    "qwen3_next": ("Qwen3Next", EXPERTS | dict(mlp_only_layers=[1], norm_topk_prob=False)),
}
GREEDY = protocol.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
SNAPSHOTS = 2  # the prefix cache's state rows (scheduler.state_snapshots): few, so that a third prompt evicts one


@pytest.fixture(scope="module", params=list(FAMILIES))
def hybrid(request, tmp_path_factory):
    """(family, transformers model, our Engine loaded from its saved directory)."""
    stem, overrides = FAMILIES[request.param]
    torch.manual_seed(0)
    config = getattr(transformers, f"{stem}TextConfig", None) or getattr(transformers, f"{stem}Config")
    config = config(**NUMBERS, **overrides)
    assert config.layer_types.count("linear_attention") >= 2 and "full_attention" in config.layer_types
    hf = centred_norms(redraw(getattr(transformers, f"{stem}ForCausalLM")(config)))
    out = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(out)
    engine = Engine(load_model(open_checkpoint(out), progress=False), BUCKETS, PAGE_SIZE, NUM_PAGES, state_snapshots=SNAPSHOTS)
    return request.param, hf, out, engine


def centred_norms(hf):
    """Qwen3.5's norms scale by (1 + w) (all but the linear layers' output norm): w redrawn in
    [-0.5, 0.5], so each scales by 0.5 .. 1.5 as the other families' redrawn norms do. Drawn in
    [0.5, 1.5], every layer grew the residual stream and transformers' own float32 logits strayed
    from its float64 ones by up to 6e-4 (over this test's tolerance) at some positions."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                p.sub_(1.0)
    return hf


def test_logits_match_transformers_through_chunked_prefill_beside_decode(hybrid):
    name, hf, _, engine = hybrid
    requests = [(f"p{i}", p) for i, p in enumerate(random_prompts(NUMBERS["vocab_size"]))]
    driver = Driver(engine, PAGE_SIZE, NUM_PAGES, budget=BUDGET, max_running=4, keep_logits=True, prefix_cache=False)
    traces = driver.run([(rid, prompt, GREEDY) for rid, prompt in requests])
    assert any(len(s.seqs) > 1 and s.seqs[-1].num_tokens > 1 for s in driver.steps)  # prefill beside decode
    assert sum(1 for s in driver.steps if any(q.rid == "p0" and q.num_tokens > 1 for q in s.seqs)) == 3  # p0 in three chunks
    worst = 0.0
    for rid, prompt in requests:
        tokens, logits = hf_greedy(hf, prompt)
        assert traces[rid].tokens == tokens, f"{name} {rid}"
        worst = max(worst, float(np.abs(np.stack(traces[rid].logits) - logits).max()))
    print(f"{name}: max |logit diff| over prompts of {PROMPT_LENGTHS}, {NEW_TOKENS} steps each: {worst:.2e}")  # -rP
    assert worst <= TOLERANCE


def test_the_weights_read_back_by_hugging_face_name_are_the_checkpoints(hybrid):
    """What a hot weight update by name writes and reads: q_proj whole (query and gate), the linear layers' own, Qwen3-Next's fused."""
    _, _, out, engine = hybrid
    assert_weights_read_back(engine, out)


def test_a_prefix_hit_starts_from_the_kept_state_and_gives_the_tokens_and_logits_of_a_miss(hybrid):
    """x's prefill saves its linear layers' state at its last page boundary (40); the same prompt then
    hits those 40 tokens beside another prompt's prefill and gives x's tokens and logits; once two
    other prompts took both snapshot rows, x misses again (its pages alone cannot resume it) and
    still gives them."""
    name, _, _, engine = hybrid
    assert engine.cache.state.shape[1] == engine.cache.conv.shape[1] == BUCKETS.max_rows + SNAPSHOTS  # slots, then snapshots
    rng = np.random.default_rng(1)
    x, w, y, z = (rng.integers(0, NUMBERS["vocab_size"], n).tolist() for n in (43, 30, 17, 17))
    greedy = protocol.SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    driver = Driver(engine, PAGE_SIZE, NUM_PAGES, budget=BUDGET, max_running=4, keep_logits=True, prefix_cache=True)
    miss = driver.run([("a", x, greedy)])["a"]
    assert [(q.state_to, q.context_len) for s in driver.steps for q in s.seqs if q.state_to >= 0] == [(0, 40)]
    hit = driver.run([("b", x, greedy), ("c", w, greedy)])["b"]
    first = next(q for s in driver.steps for q in s.seqs if q.rid == "b")
    assert (first.state_from, first.context_len - first.num_tokens) == (0, 40)
    assert any(len(s.seqs) > 1 for s in driver.steps if any(q.rid == "b" for q in s.seqs))  # beside c
    driver.run([("y", y, greedy)])
    driver.run([("z", z, greedy)])  # takes the least recently used row: x's
    again = driver.run([("e", x, greedy)])["e"]
    first = next(q for s in driver.steps for q in s.seqs if q.rid == "e")
    assert (first.state_from, first.context_len - first.num_tokens) == (-1, 0)
    worst = 0.0
    for trace in (hit, again):
        assert trace.tokens == miss.tokens, name
        worst = max(worst, float(np.abs(np.stack(trace.logits) - np.stack(miss.logits)).max()))
    print(f"{name}: max |logit diff| hit and evicted vs miss: {worst:.2e}")  # -rP
    assert worst <= TOLERANCE
