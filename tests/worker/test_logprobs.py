"""Logprobs, alternatives, prompt scores, penalties and logit bias on the tiny random Llama, driven
by the real scheduler core, each against a float64 recomputation from a full prefill's logits (or
from the step's own logits, kept): however the prompt is cut into steps and sub-steps, whatever
shares the batch, and with nothing compiled after start-up.
"""

import numpy as np
import pytest

from jaxstream import protocol
from jaxstream.arrays import from_wire, to_wire
from tests.worker.conftest import BUCKETS, PAGE_SIZE, tiny_engine
from tests.worker.driver import Driver
from tests.worker.test_engine import PROMPTS, drive
from worker_svc.batch import Buckets
from worker_svc.compiles import counter

SP = protocol.SamplingParams
FULL = Buckets((64,), (0,), 64, 24)  # one 64-token step, every position's logits a row


@pytest.fixture(scope="module")
def reference():
    return tiny_engine(FULL)


def all_logits(reference, tokens: list[int]) -> np.ndarray:
    """float64 logits [n, V] at every position of `tokens`, from one prefill of the whole sequence."""
    n = len(tokens)
    seq = protocol.StepSeq("x", 0, n, n, True, SP())
    table = np.arange(-(-n // PAGE_SIZE), dtype=np.int32)[None]
    step = protocol.Step(0, (seq,), to_wire(np.asarray(tokens, np.int32)), to_wire(np.arange(n, dtype=np.int32)), to_wire(table))
    (sub,) = reference.packer.pack(step, [SP()])
    every = sub.inputs._replace(sample_at=np.arange(64, dtype=np.int32))
    logits, _, reference.cache = reference.executables.forward(sub.shape)(reference.params, reference.cache, every, reference.last)
    return np.asarray(logits, np.float64)[:n]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits - logits.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def distribution(logits: np.ndarray, s: protocol.SamplingParams, processed: np.ndarray | None = None) -> np.ndarray:
    """The float64 logprobs [.., V] a request's logprobs are defined over (engine.py's docstring):
    of the raw logits for raw_logprobs, else of processed / T, processed = logits + bias unless given."""
    if s.raw_logprobs:
        return log_softmax(logits)
    if processed is None:
        processed = logits.copy()
        for token, bias in s.logit_bias:
            processed[..., token] += bias
    return log_softmax(processed / (s.temperature if s.temperature >= 1e-5 else 1.0))


def best(lp: np.ndarray, n: int) -> np.ndarray:
    return np.lexsort((np.arange(len(lp)), -lp))[:n]  # best first, lower id first on ties


def penalize(logits: np.ndarray, s: protocol.SamplingParams, prompt: list[int], output: list[int]) -> np.ndarray:
    """The definition (layers/penalties.py) in float64, from the request's own tokens."""
    l = logits.astype(np.float64).copy()
    for token, bias in s.logit_bias:
        l[token] += bias
    seen = np.zeros(len(l), bool)
    seen[prompt + output] = True
    l = np.where(seen, np.where(l > 0, l / s.repetition_penalty, l * s.repetition_penalty), l)
    count = np.bincount(np.asarray(output, np.int64), minlength=len(l))
    return l - (s.frequency_penalty * count + s.presence_penalty * (count > 0))


SCORED = {  # rid: (prompt, sampling): every scoring variant at once
    "a": (PROMPTS["r5"], SP(max_new_tokens=2, temperature=0.7, top_logprobs=5, prompt_logprobs_from=0, ignore_eos=True,
                            token_ids_logprob=(100, 3, 0, 57))),
    "b": (PROMPTS["r3"], SP(max_new_tokens=2, temperature=0.5, raw_logprobs=True, prompt_logprobs_from=7, ignore_eos=True,
                            token_ids_logprob=tuple(range(0, 101, 2)))),
    "c": (PROMPTS["r2"], SP(max_new_tokens=2, temperature=0.0, logit_bias=((3, 2.5), (50, -4.0)), top_logprobs=3, prompt_logprobs_from=1,
                            ignore_eos=True)),
    "d": (PROMPTS["r4"], SP(max_new_tokens=2, top_logprobs=2, prompt_logprobs_from=0, ignore_eos=True)),  # one token: position 0 alone
    "e": (PROMPTS["r7"], SP(max_new_tokens=2, ignore_eos=True)),
    "f": (PROMPTS["r6"], SP(max_new_tokens=2, temperature=1.3, top_logprobs=20, prompt_logprobs_from=3, frequency_penalty=1.0,
                            ignore_eos=True)),
}


@pytest.mark.parametrize("budget", [16, 5, 64], ids=["chunked across steps", "odd chunks", "split into sub-steps"])
def test_prompt_scores_equal_a_full_recompute_at_every_position(engine, reference, budget):
    traces, driver = drive(engine, [(rid, p, s) for rid, (p, s) in SCORED.items()], budget=budget, keep_logits=False)
    if budget == 64:
        # A scored prompt chunk larger than the largest bucket: cut between sub-steps.
        assert any(q.score_from >= 0 and q.num_tokens > engine.buckets.tokens[-1] for s in driver.steps for q in s.seqs)
    else:
        assert any(q.next_token >= 0 for s in driver.steps for q in s.seqs)  # a chunk's last logits scored the next chunk's first
    for rid, (prompt, s) in SCORED.items():
        scores = traces[rid].scores
        if s.prompt_logprobs_from < 0:
            assert scores == []
            continue
        for a, b in zip(scores, scores[1:]):  # contiguous across steps
            assert a.first + len(a.token_ids) == b.first
        k = s.prompt_logprobs_from
        assert scores[0].first == k
        assert [t for x in scores for t in x.token_ids] == prompt[k:]
        got = np.array([lp for x in scores for lp in x.logprobs])
        lp = distribution(all_logits(reference, prompt), s)  # [n, V]: row q - 1 predicts position q
        want = np.array([np.nan if q == 0 else lp[q - 1, prompt[q]] for q in range(k, len(prompt))])
        np.testing.assert_allclose(got, want, atol=1e-5, equal_nan=True)
        # Each token's rank as vLLM counts it: the tokens at least as likely, itself included; position 0 none (0).
        ranks = np.concatenate([from_wire(x.ranks) for x in scores])
        want_ranks = [0 if q == 0 else int((lp[q - 1] >= lp[q - 1, prompt[q]]).sum()) for q in range(k, len(prompt))]
        assert ranks.tolist() == want_ranks, rid
        asked = list(s.token_ids_logprob)
        if asked:
            of_ids = np.concatenate([from_wire(x.ids_logprobs) for x in scores])
            assert of_ids.shape == (len(prompt) - k, len(asked))
            want_ids = np.array([np.full(len(asked), np.nan) if q == 0 else lp[q - 1, asked] for q in range(k, len(prompt))])
            np.testing.assert_allclose(of_ids, want_ids, atol=1e-5, equal_nan=True)
        else:
            assert all(x.ids_logprobs is None for x in scores)
        if not s.top_logprobs:
            assert all(x.top_ids is None for x in scores)
            continue
        ids = np.concatenate([from_wire(x.top_ids) for x in scores])
        lps = np.concatenate([from_wire(x.top_logprobs) for x in scores])
        assert ids.shape == (len(prompt) - k, s.top_logprobs)
        for i, q in enumerate(range(k, len(prompt))):
            if q == 0:
                assert (ids[i] == -1).all() and np.isnan(lps[i]).all()
                continue
            np.testing.assert_array_equal(ids[i], best(lp[q - 1], s.top_logprobs))
            np.testing.assert_allclose(lps[i], lp[q - 1, ids[i]], atol=1e-5)


def test_alternatives_hold_the_sampled_token_with_its_logprob(engine):
    requests = [
        ("seeded", PROMPTS["r3"], SP(max_new_tokens=8, temperature=0.8, seed=5, top_logprobs=5, ignore_eos=True)),
        ("greedy_raw", PROMPTS["r1"], SP(max_new_tokens=8, temperature=0.0, raw_logprobs=True, top_logprobs=20, ignore_eos=True)),
        ("hot_raw", PROMPTS["r0"], SP(max_new_tokens=8, temperature=1.7, seed=1, raw_logprobs=True, top_logprobs=1, ignore_eos=True)),
        ("plain", PROMPTS["r2"], SP(max_new_tokens=8, temperature=0.0, ignore_eos=True)),
    ]
    traces, _ = drive(engine, requests)
    for rid, _, s in requests:
        trace = traces[rid]
        if s.top_logprobs:
            assert len(trace.top_ids) == len(trace.tokens)
        for token, logprob, logits, ids, lps in zip(trace.tokens, trace.logprobs, trace.logits, trace.top_ids, trace.top_logprobs):
            lp = distribution(np.asarray(logits, np.float64), s)
            assert abs(logprob - lp[token]) < 1e-5
            n = s.top_logprobs or len(ids)
            np.testing.assert_array_equal(ids[:n], best(lp, n))
            np.testing.assert_allclose(lps[:n], lp[ids[:n]], atol=1e-5)
            assert (np.diff(lps[:n]) <= 0).all()
            if s.temperature == 0:
                assert ids[0] == token
            if token in ids[:n] and s.top_logprobs:  # the same float, not merely close
                assert np.float32(lps[list(ids).index(token)]) == np.float32(logprob)
    # Alone, the same tokens and logprobs to float32's rounding: the page-list attention's chunk
    # follows the step's longest context, so its sums may round apart (bit for bit is
    # worker.batch_invariant's promise, tests/worker/test_batch_invariant.py).
    alone, _ = drive(engine, [requests[-1]])
    assert alone["plain"].tokens == traces["plain"].tokens
    np.testing.assert_allclose(alone["plain"].logprobs, traces["plain"].logprobs, atol=1e-5)


def test_token_ids_logprob_are_the_sampled_rows_distribution_at_those_ids(engine):
    asked = (7, 0, 100, 42, 13)
    requests = [
        ("temp", PROMPTS["r3"], SP(max_new_tokens=6, temperature=0.8, seed=5, token_ids_logprob=asked, ignore_eos=True)),
        ("raw", PROMPTS["r1"], SP(max_new_tokens=6, temperature=1.7, seed=1, raw_logprobs=True, token_ids_logprob=asked[:2], ignore_eos=True)),
        ("cut", PROMPTS["r0"], SP(max_new_tokens=6, temperature=0.9, seed=2, top_k=5, processed_logprobs=True,
                                  token_ids_logprob=tuple(range(37, 101)), ignore_eos=True)),  # MAX_TOKEN_IDS_LOGPROB of them
        ("none", PROMPTS["r2"], SP(max_new_tokens=6, temperature=0.0, ignore_eos=True)),
    ]
    traces, _ = drive(engine, requests)
    for rid, _, s in requests:
        trace = traces[rid]
        ids = list(s.token_ids_logprob)
        if not ids:  # nothing comes back for a step where no row asked; zeros beside rows that did
            assert 0 < len(trace.ids_logprobs) < len(trace.tokens) and not np.any(trace.ids_logprobs)
            continue
        assert len(trace.ids_logprobs) == len(trace.tokens), rid
        for token, logprob, logits, row in zip(trace.tokens, trace.logprobs, trace.logits, trace.ids_logprobs):
            lp = distribution(np.asarray(logits, np.float64), s)
            if s.processed_logprobs:  # the top-k cut, renormalized: -inf outside it
                kept = best(lp, s.top_k)
                lp = np.full_like(lp, -np.inf)
                lp[kept] = distribution(np.asarray(logits, np.float64)[kept], s)
            np.testing.assert_allclose(row[: len(ids)], lp[ids], atol=1e-5)
            assert abs(row[ids.index(token)] - logprob) < 1e-5 if token in ids else True
    assert 64 - 5 <= np.isinf(traces["cut"].ids_logprobs[0]).sum() < 64  # the cut's ids finite, every other -inf


PENALIZED = {
    "all": SP(max_new_tokens=14, temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.8, presence_penalty=0.5, ignore_eos=True),
    "rep": SP(max_new_tokens=14, temperature=0.0, repetition_penalty=2.0, ignore_eos=True),
    "freq": SP(max_new_tokens=14, temperature=0.0, frequency_penalty=1.5, ignore_eos=True),
    "pres_bias": SP(max_new_tokens=14, temperature=0.0, presence_penalty=2.0, logit_bias=((11, 1.5),), ignore_eos=True),
    "sampled": SP(max_new_tokens=14, temperature=0.9, seed=3, repetition_penalty=0.7, frequency_penalty=-0.5, top_logprobs=4,
                  ignore_eos=True),
}


def test_penalties_change_greedy_tokens_as_the_float64_reference_predicts(engine):
    prompt = PROMPTS["r3"]
    requests = [(rid, prompt, s) for rid, s in PENALIZED.items()] + [("plain", PROMPTS["r1"], SP(max_new_tokens=14, temperature=0.0,
                                                                                              ignore_eos=True))]
    traces, _ = drive(engine, requests, budget=16)
    unpenalized = drive(engine, [("x", prompt, SP(max_new_tokens=14, temperature=0.0, ignore_eos=True))])[0]["x"].tokens
    for rid, s in PENALIZED.items():
        trace = traces[rid]
        for i, (token, logprob, logits) in enumerate(zip(trace.tokens, trace.logprobs, trace.logits)):
            processed = penalize(np.asarray(logits), s, prompt, trace.tokens[:i])
            lp = distribution(np.asarray(logits, np.float64), s, processed)
            assert abs(logprob - lp[token]) < 1e-5, (rid, i)
            if s.temperature == 0:
                runner_up = np.sort(processed)[-2]
                assert token == np.argmax(processed) or processed.max() - runner_up < 1e-4, (rid, i)
        assert trace.tokens != unpenalized, rid  # the penalties did something
    alone = drive(engine, [requests[-1]])[0]["plain"]  # the others' penalties do not reach it (bit-equal across
    assert alone.tokens == traces["plain"].tokens  # batches only under batch_invariant: test_batch_invariant.py)
    np.testing.assert_allclose(alone.logprobs, traces["plain"].logprobs, rtol=0, atol=1e-5)


def test_penalties_survive_preemption_and_recompute(engine):
    requests = [(rid, PROMPTS[p], s) for (rid, s), p in zip(PENALIZED.items(), ("r3", "r5", "r2", "r6", "r7"))]
    roomy, _ = drive(engine, requests, budget=16)
    driver = Driver(engine, PAGE_SIZE, 24, 16, 8, keep_logits=False)  # 24 pages of 4: they do not all fit
    tight = driver.run(requests)
    assert driver.scheduler.core.counters.preempted_total > 0
    for rid, _, _ in requests:
        assert tight[rid].tokens == roomy[rid].tokens, rid


def test_a_large_logit_bias_forces_its_token(engine):
    forced = dict(logit_bias=((7, 100.0),), ignore_eos=True, max_new_tokens=6)
    requests = [("greedy", PROMPTS["r3"], SP(temperature=0.0, **forced)),
                ("hot", PROMPTS["r5"], SP(temperature=1.5, top_p=0.9, seed=2, **forced)),
                ("other", PROMPTS["r1"], SP(max_new_tokens=6, temperature=0.0, ignore_eos=True))]
    traces, _ = drive(engine, requests)
    for rid in ("greedy", "hot"):
        assert traces[rid].tokens == [7] * 6
        assert all(-1e-4 < lp <= 0 for lp in traces[rid].logprobs)
    assert traces["other"].tokens == drive(engine, [requests[-1]])[0]["other"].tokens


def test_nothing_compiles_after_start_up_with_every_feature(engine):
    before = counter().count
    mixed = [(rid, p, s) for rid, (p, s) in SCORED.items()]
    mixed += [(f"pen_{rid}", PROMPTS["r0"], s) for rid, s in PENALIZED.items()]
    mixed += [("banned", PROMPTS["r1"], SP(max_new_tokens=5, stop_token_ids=(1, 2), min_new_tokens=4, top_logprobs=2, raw_logprobs=True,
                                           token_ids_logprob=(1, 2, 99)))]
    for budget, running in ((16, 8), (5, 3), (64, 8), (16, 1)):
        drive(engine, mixed, budget=budget, max_running=running, keep_logits=False)
    assert counter().count == before
    rows = {BUCKETS.rows(t) for t in BUCKETS.tokens}
    assert engine.compiled == len(BUCKETS.shapes()) + 2 * len(rows) + len(BUCKETS.tokens)  # forward, sample, penalties, score
