"""Penalties, logit bias, the logprob variants and the top-N alternatives, each against a float64
numpy recomputation from the same logits; the token history the penalties count.

Definitions (worker_svc/layers/penalties.py, engine.py): l = logits + bias; for every token seen in
prompt or output, l = l / rp if l > 0 else l * rp; l -= frequency * count + presence * (count > 0)
with count the output occurrences. Logprob: log_softmax(l / T) (T = 1 for greedy), or with
raw_logprobs log_softmax(logits); alternatives from the same distribution, best first.
"""

import jax
import numpy as np
import pytest

from tests.unit.test_sampling import VOCAB, log_softmax, random_logits, rows
from worker_svc.history import TokenHistory
from worker_svc.layers.penalties import PenaltyInputs, apply_penalties
from worker_svc.layers.sampling import sample

penalize_jit = jax.jit(apply_penalties)
sample_jit = jax.jit(sample)
R = 8  # rows of every test here: one compiled shape each for penalties and sampling


def reference(logits, bias, seen, count, repetition, frequency, presence, blocked):
    """The definition, in float64."""
    l = logits.astype(np.float64) + bias
    rp = repetition[:, None].astype(np.float64)
    l = np.where(seen, np.where(l > 0, l / rp, l * rp), l)
    l = l - (frequency[:, None] * count + presence[:, None] * (count > 0))
    return np.where(blocked, -np.inf, l)


def penalty_case(seed: int):
    """R rows: a row without any feature (0), bias only (1), each penalty alone (2-4), all (5-7), and
    allowed_token_ids (every other token blocked) on rows 1 and 7."""
    rng = np.random.default_rng(seed)
    logits = random_logits(R, VOCAB, seed)
    bias = np.zeros((R, VOCAB), np.float32)
    seen = np.zeros((R, VOCAB), bool)
    count = np.zeros((R, VOCAB), np.int32)
    for r in (1, 5, 6, 7):
        ids = rng.choice(VOCAB, 30, replace=False)
        bias[r, ids] = rng.uniform(-5, 5, 30)
    for r in range(2, R):
        seen[r, rng.choice(VOCAB, 200, replace=False)] = True  # prompt
        out = rng.choice(VOCAB, 80, replace=True)  # output, with repeats
        np.add.at(count[r], out, 1)
        seen[r, out] = True
    repetition = np.array([1, 1, 1.3, 1, 1, 1.2, 0.8, 2.0], np.float32)
    frequency = np.array([0, 0, 0, 0.7, 0, 0.5, -0.4, 1.5], np.float32)
    presence = np.array([0, 0, 0, 0, 0.6, 0.3, 0.9, -1.0], np.float32)
    blocked = np.zeros((R, VOCAB), bool)
    for r in (1, 7):
        blocked[r] = True
        blocked[r, rng.choice(VOCAB, 40, replace=False)] = False
    return logits, PenaltyInputs(bias, seen, count, repetition, frequency, presence, blocked)


def test_penalties_and_bias_follow_the_definition_in_order():
    logits, p = penalty_case(1)
    # Order matters here: bias turns a negative logit positive, so repetition divides it.
    logits[5, 3], p.bias[5, 3], p.seen[5, 3], p.count[5, 3] = -1.0, 3.0, True, 2
    got = np.asarray(penalize_jit(logits, p))
    want = reference(logits, *p)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    assert abs(got[5, 3] - (2.0 / 1.2 - 2 * 0.5 - 0.3)) < 1e-5
    np.testing.assert_array_equal(got[0], logits[0])  # a row without any: bit-identical


def test_default_logprobs_are_of_the_processed_distribution_and_raw_ones_of_the_logits():
    logits, p = penalty_case(2)
    processed = np.asarray(penalize_jit(logits, p))
    temperature = np.array([0.0, 0.7, 1.0, 1.5, 0.0, 0.5, 1.2, 0.9], np.float32)
    raw = np.array([0, 0, 0, 0, 1, 1, 1, 0], bool)
    inputs = rows(R, temperature=temperature, top_k=[0, 5, 0, 0, 3, 0, 0, 0], top_p=[1, 1, 0.9, 1, 1, 1, 0.8, 1], seed=np.arange(R),
                  position=4, raw_logprobs=raw, top_logprobs=[0, 20, 3, 0, 5, 1, 20, 7])
    inputs = inputs._replace(banned=inputs.banned.at[7, 0].set(int(np.argmax(processed[7]))))  # row 7 bans its best
    out = sample_jit(processed, inputs, logits)
    tokens = np.asarray(out.tokens)
    t = np.where(temperature > 0, temperature, 1.0)
    default = log_softmax(processed, t)
    raw_lp = log_softmax(logits, np.ones(R))
    want = np.where(raw[:, None], raw_lp, default)  # [R, V] each row's distribution
    np.testing.assert_allclose(np.asarray(out.logprobs), want[np.arange(R), tokens], atol=1e-5)
    assert tokens[7] != np.argmax(processed[7])  # banned, yet the logprob is of the unbanned distribution
    assert not p.blocked[np.arange(R), tokens].any()  # rows 1 and 7 sample only their allowed tokens
    # Greedy samples the processed logits even when its logprob is raw.
    assert tokens[0] == np.argmax(processed[0]) and tokens[4] == np.argmax(processed[4])

    # Alternatives: every row's 20 best under its own distribution, best first, lower id first on ties.
    ids, lps = np.asarray(out.top_ids), np.asarray(out.top_logprobs)
    assert ids.shape == lps.shape == (R, 20)
    for r in range(R):
        order = np.lexsort((np.arange(VOCAB), -want[r]))[:20]
        np.testing.assert_array_equal(ids[r], order)
        np.testing.assert_allclose(lps[r], want[r, order], atol=1e-5)
        if tokens[r] in ids[r]:  # the sampled token's entry is its logprob, to the bit
            assert lps[r][list(ids[r]).index(tokens[r])] == np.asarray(out.logprobs)[r]


def test_processed_logprobs_are_of_the_kept_tokens_renormalized():
    """vLLM's processed_logprobs: the distribution each token was drawn from, after the cut."""
    logits = random_logits(R, VOCAB, 7)
    temperature = np.array([0.7, 1.0, 1.2, 0.0, 1.0, 0.8, 1.0, 1.0], np.float32)
    top_k = np.array([5, 0, 0, 0, 3, 0, 50, 0], np.int32)
    top_p = np.array([1, 0.9, 1, 1, 1, 1, 0.5, 1], np.float32)
    min_p = np.array([0, 0, 0.1, 0, 0, 0, 0, 0], np.float32)
    processed = np.array([1, 1, 1, 1, 1, 0, 1, 1], bool)  # row 5: the default, row 7: no cut at all
    inputs = rows(R, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=np.arange(R), position=3,
                  top_logprobs=8, processed_logprobs=processed)
    inputs = inputs._replace(banned=inputs.banned.at[4, 0].set(int(np.argmax(logits[4]))))  # row 4 bans its best
    out = sample_jit(logits, inputs)
    tokens, got, ids, lps = (np.asarray(a) for a in (out.tokens, out.logprobs, out.top_ids, out.top_logprobs))
    for r in range(R):
        t = temperature[r] if temperature[r] > 0 else 1.0
        scaled = logits[r].astype(np.float64) / t
        if r == 4:
            scaled[np.argmax(logits[4])] = -np.inf
        p = np.exp(scaled - scaled.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        keep = np.zeros(VOCAB, bool)
        if temperature[r] == 0:
            keep[order[0]] = True
        else:
            keep[order[: top_k[r] or VOCAB]] = True
            if top_p[r] < 1:  # the smallest head of what top-k kept holding top_p of its mass
                mass = np.cumsum(p[order] * keep[order]) / (p * keep).sum()
                keep[order[np.argmax(mass >= top_p[r]) + 1:]] = False
            keep &= p >= min_p[r] * p.max()
        assert keep[tokens[r]]
        if not processed[r]:
            assert got[r] == pytest.approx(np.log(p[tokens[r]]), abs=1e-5)
            continue
        dist = np.full(VOCAB, -np.inf)
        dist[keep] = np.log(p[keep] / p[keep].sum())
        assert got[r] == pytest.approx(dist[tokens[r]], abs=1e-5)
        n = min(8, int(keep.sum()))
        np.testing.assert_array_equal(ids[r, :n], np.argsort(-dist, kind="stable")[:n])
        np.testing.assert_allclose(lps[r, :n], dist[ids[r, :n]], atol=1e-5)
        kept = min(int(keep.sum()), lps.shape[1])
        assert np.all(np.isfinite(lps[r, :kept])) and np.all(np.isneginf(lps[r, kept:]))  # cut: -inf, dropped downstream
    assert got[3] == 0.0  # greedy: the token it took had probability 1


def test_alternatives_break_ties_by_the_lower_id():
    logits = np.zeros((R, VOCAB), np.float32)
    logits[:, [900, 40, 7]] = 2.0  # three-way tie at the top, then everything else tied
    out = sample_jit(logits, rows(R, temperature=0.0, top_logprobs=5))
    assert np.asarray(out.top_ids)[0, :5].tolist() == [7, 40, 900, 0, 1]
    assert int(out.tokens[0]) == 7


def test_rows_without_features_are_unaffected_by_rows_with_them():
    logits = random_logits(R, VOCAB, 3)
    plain = rows(R, temperature=[0.0, 1.0, 0.7, 1.3, 0.0, 1.0, 0.6, 2.0], top_k=[0, 0, 10, 0, 0, 5, 0, 0], seed=np.arange(R) + 5, position=9)
    alone = sample_jit(logits, plain)
    mixed = plain._replace(raw_logprobs=np.array([0, 1, 0, 0, 1, 0, 0, 0], bool), top_logprobs=np.array([0, 0, 4, 0, 0, 20, 0, 0], np.int32))
    # The rows that ask for raw logprobs see other raw logits; the plain rows must not notice.
    raw = logits + np.random.default_rng(0).standard_normal(logits.shape).astype(np.float32)
    together = sample_jit(logits, mixed, raw)
    np.testing.assert_array_equal(np.asarray(together.tokens), np.asarray(alone.tokens))
    plain_rows, top_rows = [0, 3, 6, 7], [2, 5]
    np.testing.assert_array_equal(np.asarray(together.logprobs)[plain_rows], np.asarray(alone.logprobs)[plain_rows])
    # Rows with alternatives read their logprob where the alternatives are read: equal up to rounding.
    np.testing.assert_allclose(np.asarray(together.logprobs)[top_rows], np.asarray(alone.logprobs)[top_rows], rtol=1e-6)
    assert not np.asarray(alone.top_ids).any()  # no row asked: no alternatives computed


def test_history_counts_prompt_and_output_and_restarts_on_a_recompute():
    vocab, prompt = 50, np.array([3, 3, 9, 11], np.int32)
    history = TokenHistory(capacity=2)
    history.feed("a", 0, prompt[:3], prompt_len=4)
    history.feed("a", 3, prompt[3:], prompt_len=4)  # the prompt's second chunk
    for position, token in ((4, 9), (5, 20), (6, 20)):  # decodes feed the previous outputs
        history.feed("a", position, np.array([token], np.int32), prompt_len=4)

    def rows_of(rid):
        seen, count = np.zeros(vocab, bool), np.zeros(vocab, np.int32)
        history.fill(rid, seen, count)
        return seen, count

    seen, count = rows_of("a")
    assert np.flatnonzero(seen).tolist() == [3, 9, 11, 20]
    assert {int(i): int(count[i]) for i in np.flatnonzero(count)} == {9: 1, 20: 2}  # the output only
    # A recompute after preemption from position 0, then from a cached prefix: the same history.
    history.feed("a", 0, np.array([3, 3, 9, 11, 9, 20], np.int32), prompt_len=4)
    history.feed("a", 6, np.array([20], np.int32), prompt_len=4)
    assert [r.tolist() for r in rows_of("a")] == [r.tolist() for r in (seen, count)]
    history.feed("a", 5, np.array([21, 22], np.int32), prompt_len=4)  # superseded from position 5 on
    assert history.tokens("a").tolist() == [3, 3, 9, 11, 9, 21, 22]
    assert {int(i): int(c) for i, c in enumerate(rows_of("a")[1]) if c} == {9: 1, 21: 1, 22: 1}
    # Least recently fed first out beyond the capacity.
    history.feed("b", 0, np.array([1], np.int32), prompt_len=1)
    history.feed("a", 7, np.array([5], np.int32), prompt_len=4)
    history.feed("c", 0, np.array([2], np.int32), prompt_len=1)
    assert "b" not in history and "a" in history and "c" in history and len(history) == 2
