"""Qwen3.5 (dense), Qwen3.5-MoE and Qwen3-Next, hybrids of Gated DeltaNet linear-attention layers
and gated full-attention layers: each a small random checkpoint made by transformers (weights
redrawn; three linear layers and one full, as released) against transformers' own model in
float32, through the real scheduler core (tests/worker/driver.py): a 75-token prompt prefilled in
three chunks beside the others' decode, so each linear layer carries its recurrent and convolution states from chunk to chunk and across decode
steps, per request slot. With the prefix cache on, a hit starts the linear layers from the state
snapshot kept where the hit ends (scheduler_svc/snapshots.py) and gives the tokens and logits of a miss. Also: the weights read back by name, a
weight update by name, the routed experts, int8 weights; and tp2, ep2 and batch_invariant (hybrid_tp.py,
in the suite's idle time).

    python -m pytest tests/model/test_hybrid.py -rP    # also prints the largest difference
"""

import copy
import json
import shutil
from collections import Counter

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxstream import protocol
from tests.model.hybrid_tp import INVARIANT, PLAIN
from tests.model.parity import (BUCKETS, BUDGET, NEW_TOKENS, NUM_PAGES, PAGE_SIZE, PROMPT_LENGTHS,
                                assert_routed_experts_are_transformers, assert_weights_read_back, random_prompts, redraw)
from tests.model.test_families import hf_greedy  # by one forward over the whole sequence (its chunked delta rule)
from tests.worker.driver import Driver
from tests.worker.hlo_check import copies_of
from tests.worker.test_quantization import forward
from worker_svc.engine import Engine
from worker_svc.hf_index import hf_tensors
from worker_svc.layers.numerics import Numerics
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


def hf_model(family: str):
    """The family's seeded transformers model (hybrid_tp.py saves the same)."""
    stem, overrides = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, f"{stem}TextConfig", None) or getattr(transformers, f"{stem}Config")
    config = config(**NUMBERS, **overrides)
    assert config.layer_types.count("linear_attention") >= 2 and "full_attention" in config.layer_types
    return centred_norms(redraw(getattr(transformers, f"{stem}ForCausalLM")(config)))


@pytest.fixture(scope="module", params=list(FAMILIES))
def hybrid(request, tmp_path_factory):
    """(family, transformers model, its saved directory, our Engine loaded from it, capturing routed experts)."""
    hf = hf_model(request.param)
    out = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(out)
    engine = Engine(load_model(open_checkpoint(out), progress=False), BUCKETS, PAGE_SIZE, NUM_PAGES, state_snapshots=SNAPSHOTS,
                    routed_experts=True)
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


def test_no_compiled_forward_copies_a_state_array_whole(hybrid):
    """The layer scan carries both state arrays; a layer gets its rows' start states gathered before the
    switch over layer kinds and its end states scattered after it (worker_svc/layers/states.py). Handed
    the arrays themselves, the full-attention branch passed them through and XLA copied both whole in
    the scan's body: a pass over every slot's state per layer and step. Every forward the tests above
    compiled (the first shape alone where none ran), with snapshot rows and the routed experts."""
    name, _, _, engine = hybrid
    first = BUCKETS.shapes()[0]
    forwards = engine.executables.forwards or {first: engine.executables.forward(first)}
    for shape, compiled in forwards.items():
        assert copies_of(compiled.as_text(), (engine.cache.conv.shape, engine.cache.state.shape)) == [], (name, shape)


def test_routed_experts_are_the_ones_transformers_router_picks(hybrid):
    """R3 on the hybrid MoE: each MoE layer's experts as transformers' `mlp.gate` picks them, Qwen3-Next's
    dense layer zeros; the dense Qwen3.5 has no MoE layer, so its engine captures nothing."""
    _, hf, _, engine = hybrid
    if "num_experts" not in hf.config:
        assert engine.experts is None
        return
    assert_routed_experts_are_transformers(hf, {"fused": engine}, "gate", NUMBERS["vocab_size"], EXPERTS["num_experts_per_tok"])


def test_int8_weights_give_transformers_logits_on_the_dequantized_weights(hybrid, tmp_path):
    """worker.quantization=int8 computes the model of its own weights dequantized: transformers loaded with
    them (read back by name) gives the same logits to float32 tolerance. What int8 moves from the float32
    model's logits is then the weights' rounding alone; on these tiny random models (logit std ~1, top
    logits close) it is more than parity.py's bound allows for other families (printed, -rP), so that bound
    is not asserted here: the exact identity above is the sound check of the int8 path (each weight
    quantized along its own input axes)."""
    name, hf, out, _ = hybrid
    tokens = np.asarray(random_prompts(NUMBERS["vocab_size"])[1] * 3)
    model = load_model(open_checkpoint(out), progress=False, numerics=Numerics(quantization="int8"))
    int8 = forward(model, tokens)
    shutil.copy(out / "config.json", tmp_path)
    save_file(dict(hf_tensors(model)), tmp_path / "model.safetensors", metadata={"format": "pt"})
    dequantized = type(hf).from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        theirs = dequantized(torch.tensor([tokens.tolist()])).logits[0].numpy()
        exact = hf(torch.tensor([tokens.tolist()])).logits[0].numpy()
    moved = np.abs(int8 - exact).max(-1)
    print(f"{name} int8: against transformers on the dequantized weights {np.abs(int8 - theirs).max():.2e}; against float32, "
          f"max |logit diff| per token median {np.median(moved):.3f}, max {moved.max():.3f} (logit std {exact.std():.2f}), "
          f"argmax equal at {(int8.argmax(-1) == exact.argmax(-1)).mean():.0%}")  # -rP
    assert np.abs(int8 - theirs).max() <= TOLERANCE
    assert np.median(moved) > 10 * TOLERANCE  # the weights were quantized


def test_a_weight_update_by_hugging_face_name_gives_transformers_logits_on_the_new_weights(hybrid, tmp_path):
    """The engine's swap path (stage by name, commit): the weights of another draw, pushed as a trainer
    pushes them, then a request's greedy tokens and logits are transformers' on that draw; the fixture's
    weights pushed back after."""
    name, hf, out, engine = hybrid
    torch.manual_seed(1)
    new = centred_norms(redraw(copy.deepcopy(hf)))
    new.save_pretrained(tmp_path)
    prompt = random_prompts(NUMBERS["vocab_size"])[2]
    try:
        engine.stage_tensors(load_file(str(tmp_path / "model.safetensors")).items())
        engine.commit_weights()
        trace = Driver(engine, PAGE_SIZE, NUM_PAGES, budget=BUDGET, max_running=4, keep_logits=True,
                       prefix_cache=False).run([("new", prompt, GREEDY)])["new"]
    finally:
        engine.stage_tensors(load_file(str(out / "model.safetensors")).items())
        engine.commit_weights()
    tokens, logits = hf_greedy(new, prompt)
    with torch.no_grad():
        before = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].numpy()  # the fixture's weights
    assert trace.tokens == tokens, name
    assert np.abs(np.stack(trace.logits) - logits).max() <= TOLERANCE < np.abs(before - logits).max()


@pytest.fixture(scope="module")
def sharded(hybrid_sharded_runs) -> dict:
    """hybrid_tp.py's results, run in the suite's idle time (tests/background.py)."""
    return hybrid_sharded_runs.arrays("hybrid_tp")


def test_tensor_and_expert_parallel_runs_match_transformers_too(hybrid, sharded):
    """tp2 (`fused`: both kinds of layer split by head, the states with them) and, for the MoE ones, ep2 (`ep`)
    on fake devices, the same checkpoint (hf_model is seeded). The tp2 forward step's collectives are the
    embedding's and each layer stack's two row-parallel reductions (its token mixer's output projection,
    its MLP's), [T, D] each, then the logits' gather: nothing of the linear layers crosses shards before
    their output projection. Besides, a MoE layer's fused experts gather their weights as Qwen3-MoE's do."""
    name, hf, _, _ = hybrid
    worst, expected = {}, [hf_greedy(hf, prompt) for prompt in random_prompts(NUMBERS["vocab_size"])]
    for run in ("tp2", "ep2") if "num_experts" in hf.config else ("tp2",):
        diffs = []
        for i, (tokens, logits) in enumerate(expected):
            assert sharded[f"{name}/{run}/p{i}/tokens"].tolist() == tokens, f"{run} p{i}"
            diffs.append(float(np.abs(sharded[f"{name}/{run}/p{i}/logits"] - logits).max()))
        worst[run] = max(diffs)
    print(f"{name}: max |logit diff| " + ", ".join(f"{run} {d:.2e}" for run, d in worst.items()))  # -rP
    assert max(worst.values()) <= TOLERANCE, worst
    shards = json.loads(str(sharded[f"{name}/tp2/state_shards"]))
    assert shards == {"conv": [3, BUCKETS.max_rows, 3, 1, 32], "state": [3, BUCKETS.max_rows, 2, 8, 8]}  # Nk 2 -> 1, N 4 -> 2
    assert sharded[f"{name}/tp2/state_copies"].tolist() == []  # nor does a shard copy its states whole (layers/states.py)
    ops = Counter(sharded[f"{name}/tp2/collectives"].tolist())
    reduces = {op: n for op, n in ops.items() if op.startswith("all-reduce")}
    T, D = int(sharded[f"{name}/tp2/tokens_per_step"]), NUMBERS["hidden_size"]
    assert reduces == {f"all-reduce f32[{T},{D}]{{1,0}}": 1 + 2 * int(sharded[f"{name}/tp2/stacks"])}, ops
    gathers = [op for op in ops if not op.startswith("all-reduce")]
    assert all(op.startswith("all-gather") for op in gathers), ops
    assert f"all-gather f32[{BUCKETS.max_rows},{NUMBERS['vocab_size']}]{{0,1}}" in gathers, ops
    if "num_experts" not in hf.config:
        assert len(gathers) == 1, ops


@pytest.mark.parametrize("name", INVARIANT)
def test_batch_invariant_keeps_a_request_bit_identical_alone_and_in_a_crowd(name, sharded):
    """hybrid_tp.py's invariant_check.py runs: the delta rule token by token and every row sum in tiles keep a
    request's greedy tokens, logprobs and top logprobs bit-identical alone and among 12 others (its prompt
    chunked differently); without the mode the crowd moves its logprobs, and alone the chunked rule gives the
    token-by-token one's tokens and logprobs to float tolerance."""
    runs = json.loads(str(sharded[f"{name}/batch_invariant"]))
    assert runs["alone"] == runs["crowd"] and len(runs["alone"][0]) == 10, name
    if name == PLAIN:
        (plain, crowd), alone = runs["plain"], runs["alone"]
        assert plain[0] == alone[0] and np.abs(np.subtract(plain[1], alone[1])).max() <= TOLERANCE
        assert plain[0] == crowd[0] and plain[1] != crowd[1]
