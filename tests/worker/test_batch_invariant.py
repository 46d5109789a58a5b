"""worker.batch_invariant (layers/numerics.py): one request's tokens, logprobs, alternatives,
prompt logprobs and routed experts are bit-identical run alone and inside 31 others (random lengths, so chunked
prefills beside decodes in mixed steps), under another token budget, other compiled buckets, after
a prefix-cache hit, and verifying n-gram drafts (speculative decoding); seeded sampling included. A tiny random Qwen3-MoE (attention with
QK-norm, a fused MoE layer and a dense one) on the real engine and scheduler core.

Without the mode the same runs differ: the figure is printed (`pytest -s`) for the closing note."""

import json

import numpy as np
from flax import nnx

from jaxstream import protocol
from jaxstream.arrays import from_wire
from scheduler_svc.ngram import NgramDrafter
from tests.worker.driver import Driver
from worker_svc.batch import Buckets
from worker_svc.engine import Engine
from worker_svc.layers.numerics import Numerics
from worker_svc.models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig

MOE = Qwen3MoeConfig(vocab=211, dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp_dim=96, rope_theta=10000.0,
                     norm_eps=1e-6, tie_embeddings=True, experts=8, top_k=2, moe_mlp_dim=32, norm_topk_prob=True,
                     moe_layers=(0,))
PAGE_SIZE, NUM_PAGES = 4, 512
# Two geometries a step can be padded and cut into: another token budget, other buckets. Few
# buckets each: every shape a run meets compiles (~1.2 s), and a step padded into a wider bucket
# than it needs is as much a test of invariance as one that fits (7x4 and 3x3 buckets took 84 s
# for this file, these 46 s).
WIDE = Buckets(tokens=(1, 8, 64), pairs=(0, 256, 1024), max_rows=32, max_pages=64)
NARROW = Buckets(tokens=(2, 16), pairs=(0, 1024), max_rows=32, max_pages=64)

rng = np.random.default_rng(5)
PROMPT = rng.integers(0, MOE.vocab, 37).tolist()
TARGET = protocol.SamplingParams(max_new_tokens=12, temperature=0.9, seed=7, ignore_eos=True, top_logprobs=3, prompt_logprobs_from=29,
                                 return_routed_experts=True)
LOOP_PROMPT = PROMPT[:12] * 3
LOOPING = protocol.SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, top_logprobs=3, prompt_logprobs_from=30,
                                  return_routed_experts=True)
OTHERS = [(f"other-{i}", rng.integers(0, MOE.vocab, int(rng.integers(3, 90))).tolist(),
           protocol.SamplingParams(max_new_tokens=int(rng.integers(1, 20)), temperature=float(rng.choice([0.0, 1.0])),
                                   seed=i, ignore_eos=True))
          for i in range(31)]


def engine(numerics: Numerics, buckets: Buckets) -> Engine:
    model = Qwen3Moe(MOE.__class__(**{**MOE.__dict__, "numerics": numerics}), rngs=nnx.Rngs(3))
    return Engine(model, buckets, PAGE_SIZE, NUM_PAGES, routed_experts=True)


def outputs(trace) -> tuple:
    prompt = (trace.scores[0].first, [lp for s in trace.scores for lp in s.logprobs])  # a chunked prompt scores in parts
    experts = {}  # position -> [L, k]: the routed experts, however the steps cut them
    for part in trace.experts:
        for i, row in enumerate(from_wire(part.ids).tolist()):
            experts[part.first + i] = row
    return (trace.tokens, trace.logprobs, [t.tolist() for t in trace.top_ids], [t.tolist() for t in trace.top_logprobs], prompt,
            sorted(experts.items()))


def runs(numerics: Numerics, every_way: bool = True) -> dict[str, tuple]:
    """The target's outputs in each way of running it (alone and among 31 only, unless `every_way`)."""
    wide = engine(numerics, WIDE)
    got = {"alone": Driver(wide, PAGE_SIZE, NUM_PAGES, 64, 32).run([("t-alone", PROMPT, TARGET)])["t-alone"]}
    # After 31 others: its prompt is chunked beside theirs and decodes beside their prefills and decodes.
    crowd = Driver(wide, PAGE_SIZE, NUM_PAGES, 64, 32).run([*[(r + "-a", p, s) for r, p, s in OTHERS], ("t-crowd", PROMPT, TARGET)])
    got["among 31"] = crowd["t-crowd"]
    if not every_way:
        return {way: outputs(trace) for way, trace in got.items()}
    narrow = engine(numerics, NARROW)
    got["budget 16, other buckets"] = Driver(narrow, PAGE_SIZE, NUM_PAGES, 16, 32).run(
        [*[(r + "-b", p, s) for r, p, s in OTHERS[:8]], ("t-narrow", PROMPT, TARGET)])["t-narrow"]
    cached = Driver(wide, PAGE_SIZE, NUM_PAGES, 64, 32, prefix_cache=True)
    cached.run([("warm", PROMPT[:30], protocol.SamplingParams(max_new_tokens=1, temperature=0.0))])
    got["prefix-cache hit"] = cached.run([*[(r + "-c", p, s) for r, p, s in OTHERS[8:16]], ("t-cached", PROMPT, TARGET)])["t-cached"]
    first = next(q for s in cached.steps for q in s.seqs if q.rid == "t-cached")
    assert first.context_len - first.num_tokens == 28, "the prefix cache served the warm request's 7 whole pages"
    # Speculative decoding, with overlap: decodes verify n-gram drafts, several tokens a step. The
    # target's sampled tokens rarely repeat (few drafts); a greedy request on a repeated prompt
    # loops, as random models do, and its drafts are mostly accepted.
    looping_alone = Driver(wide, PAGE_SIZE, NUM_PAGES, 64, 32).run([("l-alone", LOOP_PROMPT, LOOPING)])["l-alone"]
    drafting = Driver(wide, PAGE_SIZE, NUM_PAGES, 64, 32, drafter=NgramDrafter(4, 1, 3), overlap=True)
    crowd = drafting.run([*[(r + "-d", p, s) for r, p, s in OTHERS[16:24]], ("t-drafts", PROMPT, TARGET),
                          ("l-drafts", LOOP_PROMPT, LOOPING)])
    got["drafts verified"] = crowd["t-drafts"]
    assert outputs(crowd["l-drafts"]) == outputs(looping_alone), "a greedy request verifying drafts differs from alone"
    assert drafting.scheduler.core.stats()["spec_decode_num_accepted_tokens_total"] >= 8
    return {way: outputs(trace) for way, trace in got.items()}


def max_difference(a: tuple, b: tuple) -> float:
    if a[0] != b[0]:
        return float("inf")  # other tokens
    pairs = [(a[1], b[1]), (a[3], b[3]), (a[4][1], b[4][1])]
    return max(float(np.nanmax(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)), initial=0.0)) for x, y in pairs)


def test_a_request_is_bit_identical_alone_in_a_crowd_in_other_buckets_and_after_a_cache_hit():
    got = runs(Numerics(batch_invariant=True))
    alone = got.pop("alone")
    assert len(alone[0]) == TARGET.max_new_tokens and len(alone[2][0]) == 3 and alone[4]
    assert [p for p, _ in alone[5]] == list(range(len(PROMPT) + TARGET.max_new_tokens - 1))  # every position that ran
    for way, out in got.items():
        assert out == alone, f"{way}: differs from alone by {max_difference(out, alone)}"


def test_without_the_mode_the_same_runs_differ():
    """The check above is not vacuous: the default numerics move with the batch. Prints the figure."""
    got = runs(Numerics(), every_way=False)
    alone = got.pop("alone")
    differences = {way: max_difference(out, alone) for way, out in got.items()}
    print("without batch_invariant, max |logprob difference| to alone:", differences)
    assert max(differences.values()) > 0


def test_int8_weights_keep_a_request_bit_identical_alone_and_in_a_crowd():
    """worker.quantization=int8 under the mode: Numerics.matmul dequantizes before the tiles (converted
    within each, a one-tile step and a many-tile one differed by 5e-7). Two ways only, to stay cheap."""
    got = runs(Numerics(batch_invariant=True, quantization="int8"), every_way=False)
    assert got["among 31"] == got["alone"], max_difference(got["among 31"], got["alone"])


def test_every_family_served_since_qwen3_is_bit_identical_alone_and_in_a_crowd(fake_device_runs):
    """invariant_check.py's runs (in the suite's idle time): each family's own terms (biases, windows,
    soft-caps, sinks, its MoE) keep a request's greedy tokens, logprobs and top logprobs bit-identical
    alone and among 12 others under the mode; without it, the crowd moves some family's logprobs; and the
    mode's ordered attention gives the default paths' tokens and logprobs (to float tolerance)."""
    lines = [json.loads(line) for line in fake_device_runs.stdout("invariant_check").splitlines() if line.startswith("{")]
    assert {line["family"] for line in lines} == {"qwen2", "mistral", "mixtral", "gemma2", "gemma3", "gpt_oss", "deepseek"}, lines
    assert all(line["identical"] and line["tokens"] == 10 for line in lines), lines
    assert any(line["without_mode_moved"] for line in lines), lines
    assert all(line["mode_against_default"] is not None and line["mode_against_default"] <= 1e-4 for line in lines), lines
