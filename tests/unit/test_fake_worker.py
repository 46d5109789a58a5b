"""The fake worker's logprob fields by hand: alternatives next, next + 1, ... with logprobs lp, lp - 1, ...
(lp(t) = -(t % 10) / 10), and prompt scores of exactly the positions StepSeq.score_from names."""

import math

import numpy as np
import pytest

from gateway.errors import ApiError
from gateway.experts import routed_layout
from jaxstream import protocol
from jaxstream.arrays import from_wire, to_wire
from jaxstream.heartbeat import as_json
from tests.worker.driver import wire
from worker_svc.__main__ import stats as heartbeat_stats
from worker_svc.control import DeviceControl, Source
from worker_svc.fake import FakeEngine
from worker_svc.idle import IdleGaps

PAGE_SIZE = 4


def make_step(seqs: list[tuple]) -> protocol.Step:
    """seqs: (rid, tokens, first position, sample, sampling, prompt_len, score_from, next_token);
    row r owns pages 4r .. 4r + 3."""
    step_seqs, tokens, positions = [], [], []
    for rid, toks, p0, sample, sampling, prompt_len, score_from, next_token in seqs:
        step_seqs.append(protocol.StepSeq(rid, len(tokens), len(toks), p0 + len(toks), sample, sampling, (), prompt_len, score_from, next_token))
        tokens += toks
        positions += range(p0, p0 + len(toks))
    table = np.arange(4 * len(seqs), dtype=np.int32).reshape(len(seqs), 4)
    step = protocol.Step(1, tuple(step_seqs), to_wire(np.array(tokens, np.int32)), to_wire(np.array(positions, np.int32)), to_wire(table))
    return wire(step, protocol.WorkerInput)


def test_alternatives_and_prompt_scores_follow_the_documented_arithmetic():
    fake = FakeEngine(num_pages=16, page_size=PAGE_SIZE, vocab_size=100)
    top2, top3 = protocol.SamplingParams(top_logprobs=2), protocol.SamplingParams(top_logprobs=3)
    result = fake.step(make_step([
        # A first prompt chunk, positions 0-2 of 4, scored from 0: position 0 is NaN; its last
        # logits score position 3, whose token (9) only next_token carries.
        ("a", [5, 6, 17], 0, False, top2, 4, 0, 9),
        ("b", [41], 10, True, top3, 3, -1, -1),  # a decode: samples 42
        ("c", [98], 5, True, protocol.SamplingParams(), 2, -1, -1),  # samples 99, asks no alternatives
        # Positions 2-5 of an 8-token prompt, scored from 4: positions 4, 5 and 6 (= next_token 77).
        ("d", [30, 31, 52, 3], 2, False, protocol.SamplingParams(prompt_logprobs_from=4), 8, 4, 77),
    ]))
    result = wire(result, protocol.WorkerOutput)
    assert result.rids == ("b", "c") and result.token_ids == (42, 99) and result.logprobs == (-0.2, -0.9)
    # [S, N]: N is the step's largest top_logprobs; "c" gets them too.
    assert from_wire(result.top_ids).tolist() == [[42, 43, 44], [99, 0, 1]]
    np.testing.assert_allclose(from_wire(result.top_logprobs), [[-0.2, -1.2, -2.2], [-0.9, -1.9, -2.9]], rtol=1e-6)

    a, d = result.scores
    assert (a.rid, a.first, a.token_ids) == ("a", 0, (5, 6, 17, 9))
    assert math.isnan(a.logprobs[0]) and a.logprobs[1:] == (-0.6, -0.7, -0.9)
    assert from_wire(a.top_ids).tolist() == [[-1, -1], [6, 7], [7, 8], [18, 19]]  # after 5, 6, 17
    np.testing.assert_allclose(from_wire(a.top_logprobs), [[np.nan, np.nan], [-0.6, -1.6], [-0.7, -1.7], [-0.8, -1.8]], rtol=1e-6)
    assert (d.rid, d.first, d.token_ids, d.logprobs) == ("d", 4, (52, 3, 77), (-0.2, -0.3, -0.7))
    assert d.top_ids is None and d.top_logprobs is None


def test_prompt_alternatives_alone_cost_the_sampled_rows_nothing():
    # vLLM's prompt_logprobs without logprobs: alternatives for the prompt's positions only
    fake = FakeEngine(num_pages=16, page_size=PAGE_SIZE, vocab_size=100)
    prompt_only = protocol.SamplingParams(prompt_logprobs_from=0, prompt_top_logprobs=2)
    result = wire(fake.step(make_step([("a", [5, 6, 17], 0, True, prompt_only, 3, 0, -1)])), protocol.WorkerOutput)
    assert result.token_ids == (18,) and result.top_ids is None and result.top_logprobs is None
    assert from_wire(result.scores[0].top_ids).tolist() == [[-1, -1], [6, 7], [7, 8]]


def test_token_ids_logprob_and_prompt_ranks_follow_the_documented_arithmetic():
    fake = FakeEngine(num_pages=16, page_size=PAGE_SIZE, vocab_size=100)
    asked = protocol.SamplingParams(token_ids_logprob=(13, 4, 99), prompt_logprobs_from=0)
    result = wire(fake.step(make_step([
        ("a", [5, 6, 17], 0, True, asked, 3, 0, -1),  # a whole prompt scored from 0, then sampled (18)
        ("b", [41], 10, True, protocol.SamplingParams(token_ids_logprob=(2,)), 3, -1, -1),
        ("c", [98], 5, True, protocol.SamplingParams(), 2, -1, -1),
    ])), protocol.WorkerOutput)
    # [R, I], I the step's most: each id i gets lp(i) = -(i % 10) / 10; 0 past a row's own
    np.testing.assert_allclose(from_wire(result.ids_logprobs), [[-0.3, -0.4, -0.9], [-0.2, 0, 0], [0, 0, 0]], rtol=1e-6)
    (a,) = result.scores
    of_ids = from_wire(a.ids_logprobs)
    assert np.isnan(of_ids[0]).all()  # position 0: nothing predicts it
    np.testing.assert_allclose(of_ids[1:], [[-0.3, -0.4, -0.9]] * 2, rtol=1e-6)
    # rank of t after a: (t - a - 1) % vocab + 1; 6 after 5 is the prediction (1), 17 after 6 the 11th
    assert from_wire(a.ranks).tolist() == [0, 1, 11]


def test_a_step_asking_for_no_alternative_or_score_returns_none():
    fake = FakeEngine(num_pages=16, page_size=PAGE_SIZE, vocab_size=100)
    result = fake.step(make_step([("a", [1, 2, 3], 0, True, protocol.SamplingParams(), 3, -1, -1)]))
    assert result.token_ids == (4,) and result.top_ids is None and result.top_logprobs is None and result.scores == ()
    assert result.ids_logprobs is None
    # Scored from 1 with nothing left to score in this step (a one-token prompt): no PromptScores.
    result = fake.step(make_step([("b", [7], 0, True, protocol.SamplingParams(prompt_logprobs_from=1), 1, 1, -1)]))
    assert result.scores == ()


@pytest.mark.parametrize("switch, message", [(True, "the served model has no MoE layers"),
                                             (False, "needs the server started with worker.enable_return_routed_experts=true")])
def test_a_request_for_routed_experts_is_refused_from_the_fake_workers_facts(switch, message):
    # The fake worker is a dense model: with the switch on or off, the gateway's rule refuses a
    # request for routed experts, reading the facts as they travel with the heartbeat.
    facts = FakeEngine(num_pages=4, page_size=PAGE_SIZE, vocab_size=100, routed_experts=switch).facts
    with pytest.raises(ApiError) as refused:
        routed_layout(protocol.decoder(protocol.ModelFacts).decode(protocol.encode(facts)))
    assert refused.value.status == 400 and message in refused.value.message and refused.value.param == "return_routed_experts"


def test_the_heartbeat_carries_the_fake_workers_stats_as_the_contract_types_them():
    engine = FakeEngine(num_pages=4, page_size=PAGE_SIZE, vocab_size=100)
    sent = heartbeat_stats(engine, IdleGaps(), DeviceControl(engine, None, 0, Source(None)))
    assert protocol.decoder(protocol.Stats).decode(protocol.encode(sent)) == sent
    shown = as_json(sent)  # /stats: the facts at the top level, the fake's model has no layer count
    assert (shown["steps"], shown["moe_layers"], shown["enable_return_routed_experts"], shown["model_path"]) == (0, 0, False, "dummy")
    assert "num_hidden_layers" not in shown and "step_ms" not in shown
