"""Token sampling: greedy is argmax, logprobs are the documented ones, draws depend on (seed, position)
alone, frequencies match the filtered distribution, and each filter keeps exactly its defined set.

Sampling is deterministic given (seed, position), so the statistical tests are too: a bound of
five binomial standard deviations is a check that would catch a wrong distribution, never a flake.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstream.protocol import MAX_TOKEN_IDS_LOGPROB
from worker_svc.layers.sampling import NO_TOKEN, SamplingInputs, _inverse_cdf, sample

sample_jit = jax.jit(lambda logits, inputs: sample(logits, inputs)[:2])  # (tokens, logprobs)

# A distribution whose nucleus and min-p sets can be worked out by hand, its tokens out of order so
# that "highest first" cannot come from index order by accident.
#   probability:  0.40  0.25  0.15  0.10  0.05  0.03  0.015  0.005
#   cumulative:   0.40  0.65  0.80  0.90  0.95  0.98  0.995  1.000
HAND_PROBS = np.array([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.015, 0.005])
HAND_ORDER = np.array([5, 2, 7, 0, 3, 6, 1, 4])  # token id of each probability above
HAND_LOGITS = np.zeros(8, np.float32)
HAND_LOGITS[HAND_ORDER] = np.log(HAND_PROBS)
TRIALS = 20_000  # draws per frequency test on HAND_LOGITS, one seed each
# Each new shape costs a compile (~1-2 s); the tests share these: [8 | 1 | 50 | MANY, 1000], [TRIALS, 8].
VOCAB = 1000  # not a multiple of the search's chunk (256): the last chunk is partial
MANY = 2048


def rows(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, position=0, banned=(), raw_logprobs=False, top_logprobs=0,
         processed_logprobs=False, ids=()) -> SamplingInputs:
    """n rows of sampling inputs; each argument a scalar for all rows or a sequence of n."""
    return SamplingInputs(
        temperature=jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (n,)),
        top_k=jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (n,)),
        top_p=jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (n,)),
        min_p=jnp.broadcast_to(jnp.asarray(min_p, jnp.float32), (n,)),
        seed=jnp.broadcast_to(jnp.asarray(seed, jnp.uint32), (n,)),
        position=jnp.broadcast_to(jnp.asarray(position, jnp.int32), (n,)),
        banned=jnp.broadcast_to(jnp.asarray(list(banned) + [NO_TOKEN] * (4 - len(banned)), jnp.int32), (n, 4)),
        raw_logprobs=jnp.broadcast_to(jnp.asarray(raw_logprobs, jnp.bool_), (n,)),
        top_logprobs=jnp.broadcast_to(jnp.asarray(top_logprobs, jnp.int32), (n,)),
        processed_logprobs=jnp.broadcast_to(jnp.asarray(processed_logprobs, jnp.bool_), (n,)),
        ids=jnp.broadcast_to(jnp.asarray(list(ids) + [NO_TOKEN] * (MAX_TOKEN_IDS_LOGPROB - len(ids)), jnp.int32), (n, MAX_TOKEN_IDS_LOGPROB)),
    )


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)


def log_softmax(logits: np.ndarray, temperature: np.ndarray) -> np.ndarray:
    scaled = logits.astype(np.float64) / temperature[:, None]
    scaled -= scaled.max(axis=-1, keepdims=True)
    return scaled - np.log(np.exp(scaled).sum(axis=-1, keepdims=True))


def assert_frequencies(tokens: np.ndarray, probs: np.ndarray) -> None:
    """Counts within 5 binomial standard deviations of n * p for every token; p = 0 never drawn."""
    n = len(tokens)
    counts = np.bincount(tokens, minlength=len(probs))
    sd = np.sqrt(n * probs * (1 - probs))
    np.testing.assert_array_less(np.abs(counts - n * probs), 5 * sd + 1e-9)


def test_greedy_is_argmax_first_on_ties_and_ignores_filters():
    logits = random_logits(8, VOCAB, 1)
    logits[3, [10, 700]] = logits[3].max() + 1.0  # a tie: argmax takes the lower index
    logits[5, :] = 0.0  # all tied
    inputs = rows(8, temperature=0.0, top_k=[0, 3, 0, 0, 1, 0, 0, 0], top_p=[1, 1, 0.5, 1, 1, 1, 1, 1],
                  min_p=[0, 0, 0, 0.9, 0, 0, 0, 0], seed=np.arange(8), position=7)
    tokens, _ = sample_jit(logits, inputs)
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
    assert tokens[3] == 10 and tokens[5] == 0


def test_logprob_is_log_softmax_of_scaled_logits_before_filtering():
    logits = random_logits(8, VOCAB, 2)
    temperature = np.array([0.0, 1.0, 0.5, 2.0, 0.7, 1.3, 0.0, 0.05], np.float32)
    inputs = rows(8, temperature=temperature, top_k=[0, 0, 5, 0, 0, 2, 3, 0], top_p=[1, 1, 1, 0.8, 1, 0.9, 1, 1],
                  min_p=[0, 0, 0, 0, 0.2, 0, 0, 0], seed=np.arange(8) + 11, position=3)
    tokens, logprobs = sample_jit(logits, inputs)
    assert tokens.dtype == jnp.int32 and logprobs.dtype == jnp.float32
    expected = log_softmax(logits, np.where(temperature > 0, temperature, 1.0))  # greedy: T = 1
    np.testing.assert_allclose(logprobs, expected[np.arange(8), tokens], rtol=1e-5, atol=1e-5)


def test_a_seeded_row_draws_the_same_at_any_row_and_beside_any_rows():
    # 8 seeded rows together, then shuffled among 42 other rows whose parameters (top-k among them,
    # which switches the bisection on) and logits differ. 50 rows: the bisection's blocks of 10.
    logits = random_logits(8, VOCAB, 3, scale=1.0)
    mine = rows(8, temperature=1.0, seed=np.arange(8) * 7919 + 2**32 - 200, position=np.arange(8) + 40)
    alone_tokens, alone_logprobs = sample_jit(logits, mine)

    others = rows(42, temperature=np.linspace(0, 2, 42), top_k=np.arange(42) % 5, seed=np.arange(42), position=40)
    other_logits = random_logits(42, VOCAB, 4)
    where = np.random.default_rng(5).permutation(50)[:8]  # row of each of mine in the mixed batch
    rest = np.setdiff1d(np.arange(50), where)
    mixed_logits = np.empty((50, VOCAB), np.float32)
    mixed_logits[where], mixed_logits[rest] = logits, other_logits
    mixed = jax.tree.map(lambda a, b: jnp.zeros((50, *a.shape[1:]), a.dtype).at[where].set(a).at[rest].set(b), mine, others)
    tokens, logprobs = sample_jit(mixed_logits, mixed)

    np.testing.assert_array_equal(tokens[where], alone_tokens)
    np.testing.assert_allclose(logprobs[where], alone_logprobs, rtol=1e-6)


def test_different_positions_and_seeds_give_different_draws():
    # Uniform over 1000 tokens, 2048 independent draws: 1000 (1 - e^-2.048) ~ 871 distinct tokens,
    # sd ~ 9; a draw repeated across positions (or seeds) would give far fewer.
    logits = np.zeros((MANY, VOCAB), np.float32)
    by_position, _ = sample_jit(logits, rows(MANY, seed=42, position=np.arange(MANY)))
    by_seed, _ = sample_jit(logits, rows(MANY, seed=np.arange(MANY), position=9))
    assert len(np.unique(by_position)) > 820
    assert len(np.unique(by_seed)) > 820
    # The position is mixed into the seed's key, not added to it: (s + 1, p - 1) differs from (s, p);
    # agreement by chance is 1 in 1000 a row.
    shifted, _ = sample_jit(logits, rows(MANY, seed=np.arange(MANY) + 1, position=8))
    assert np.mean(np.asarray(shifted) == np.asarray(by_seed)) < 0.01


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
def test_frequencies_match_softmax_of_scaled_logits(temperature):
    logits = np.tile(HAND_LOGITS, (TRIALS, 1))
    tokens, _ = sample_jit(logits, rows(TRIALS, temperature=temperature, seed=np.arange(TRIALS), position=5))
    assert_frequencies(np.asarray(tokens), np.exp(log_softmax(HAND_LOGITS[None], np.array([temperature]))[0]))


# Each case: filters, and the kept probabilities of HAND_PROBS worked out by hand.
FILTER_CASES = {
    "top_k=1": (dict(top_k=1), [0.40]),
    "top_k=3": (dict(top_k=3), [0.40, 0.25, 0.15]),
    "top_k=V is off": (dict(top_k=8), HAND_PROBS),
    "top_p=0.3: the first token crosses it": (dict(top_p=0.3), [0.40]),
    "top_p=0.6: 0.65 crosses it": (dict(top_p=0.6), [0.40, 0.25]),
    "top_p=0.85: 0.90 crosses it": (dict(top_p=0.85), [0.40, 0.25, 0.15, 0.10]),
    "top_p=0.99: 0.995 crosses it": (dict(top_p=0.99), HAND_PROBS[:7]),
    "top_p=0 keeps one": (dict(top_p=0.0), [0.40]),
    "min_p=0.3: p >= 0.12": (dict(min_p=0.3), [0.40, 0.25, 0.15]),
    "min_p=0.5: p >= 0.2": (dict(min_p=0.5), [0.40, 0.25]),
    "min_p=1 keeps the top": (dict(min_p=1.0), [0.40]),
    "top_k=3 and top_p=0.6": (dict(top_k=3, top_p=0.6), [0.40, 0.25]),
    "top_k=2 and top_p=0.85": (dict(top_k=2, top_p=0.85), [0.40, 0.25]),
    # top-p of what top-k kept, renormalized (vLLM's order): 0.40 / 0.80 = 0.5, then 0.8125 >= 0.7;
    # on the whole distribution, 0.65 < 0.7 would keep a third token.
    "top_k=3 then top_p=0.7": (dict(top_k=3, top_p=0.7), [0.40, 0.25]),
    "top_k=4 then top_p=0.85": (dict(top_k=4, top_p=0.85), [0.40, 0.25, 0.15]),
    "top_p=0.85 and min_p=0.3": (dict(top_p=0.85, min_p=0.3), [0.40, 0.25, 0.15]),
    "top_k=5, top_p=0.99, min_p=0.2: p >= 0.08": (dict(top_k=5, top_p=0.99, min_p=0.2), [0.40, 0.25, 0.15, 0.10]),
    # T = 2: p' is proportional to sqrt(p), so min_p = 0.55 keeps p / 0.4 >= 0.3025, p >= 0.121.
    "T=2, min_p=0.55": (dict(temperature=2.0, min_p=0.55), [0.40, 0.25, 0.15]),
}


@pytest.mark.parametrize("filters, kept", FILTER_CASES.values(), ids=FILTER_CASES.keys())
def test_filters_keep_exactly_their_set_and_sample_it_renormalized(filters, kept):
    temperature = filters.get("temperature", 1.0)
    logits = np.tile(HAND_LOGITS, (TRIALS, 1))
    tokens, logprobs = sample_jit(logits, rows(TRIALS, **filters, seed=np.arange(TRIALS), position=1))
    weights = np.zeros(8)
    kept_ids = HAND_ORDER[: len(kept)]
    weights[kept_ids] = HAND_PROBS[: len(kept)] ** (1 / temperature)
    assert_frequencies(np.asarray(tokens), weights / weights.sum())
    assert set(np.unique(tokens).tolist()) == set(kept_ids.tolist())
    # The logprob stays the unfiltered one.
    expected = log_softmax(HAND_LOGITS[None], np.array([temperature]))[0]
    np.testing.assert_allclose(logprobs, expected[np.asarray(tokens)], atol=1e-5)


def test_top_k_1_is_greedy_at_any_temperature():
    logits = random_logits(50, VOCAB, 6)
    tokens, _ = sample_jit(logits, rows(50, temperature=np.linspace(0.1, 5, 50), top_k=1, seed=np.arange(50)))
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))


def test_top_k_support_on_a_large_vocab_is_the_top_k():
    # Many draws from one nearly flat row of logits: every one of the top 7 appears, nothing else
    # does. The top 7 lie in different chunks of the search.
    base = random_logits(1, VOCAB, 7, scale=0.1)[0]
    top7 = np.argsort(-base)[:7]
    assert len(set(top7 // 256)) > 1
    tokens, _ = sample_jit(np.tile(base, (MANY, 1)), rows(MANY, temperature=3.0, top_k=7, seed=np.arange(MANY)))
    assert set(np.unique(tokens).tolist()) == set(top7.tolist())


def test_frequencies_match_across_chunks_and_zero_probability_tokens_are_never_drawn():
    # Weight on a few tokens spread over the chunks of a 1000-token vocab (the last chunk partial),
    # the rest at -inf: probability exactly 0.
    logits = np.full(VOCAB, -np.inf, np.float32)
    ids = np.array([0, 255, 256, 511, 700, 999])
    logits[ids] = np.log([0.3, 0.1, 0.2, 0.05, 0.25, 0.1])
    tokens, _ = sample_jit(np.tile(logits, (MANY, 1)), rows(MANY, seed=np.arange(MANY), position=2))
    probs = np.zeros(VOCAB)
    probs[ids] = [0.3, 0.1, 0.2, 0.05, 0.25, 0.1]
    assert_frequencies(np.asarray(tokens), probs)


@pytest.mark.parametrize("u", [0.0, 0.5, np.nextafter(np.float32(1), np.float32(0)), 1.0])
def test_search_never_lands_on_a_zero_weight_token(u):
    # Zero weight around, between and after the positive ones, in and across chunks; u at and past
    # the top of [0, 1), where u * total can round onto the total itself.
    kept = np.zeros((1, VOCAB), np.float32)
    kept[0, [3, 300, 301, 600]] = [1e-30, 0.7, 1e-8, 0.3]
    token = int(jax.jit(_inverse_cdf)(jnp.asarray(kept), jnp.full((1,), u, jnp.float32))[0])
    assert kept[0, token] > 0


def test_a_mixed_batch_gives_each_row_what_it_gives_alone():
    logits = random_logits(8, VOCAB, 8, scale=1.0)
    inputs = rows(
        8,
        # greedy, plain, top-k, top-p, min-p, all three, greedy with filters set, top-k and min-p
        temperature=[0.0, 1.0, 0.8, 1.2, 1.0, 0.9, 0.0, 1.5],
        top_k=[0, 0, 20, 0, 0, 50, 4, 30],
        top_p=[1.0, 1.0, 1.0, 0.7, 1.0, 0.9, 0.5, 1.0],
        min_p=[0.0, 0.0, 0.0, 0.0, 0.3, 0.05, 0.1, 0.2],
        seed=[1, 2, 3, 4, 5, 6, 7, 8],
        position=[10, 11, 12, 13, 14, 15, 16, 17],
    )
    tokens, logprobs = sample_jit(logits, inputs)
    for r in range(8):
        one = jax.tree.map(lambda a: a[r : r + 1], inputs)
        alone_token, alone_logprob = sample_jit(logits[r : r + 1], one)
        assert int(tokens[r]) == int(alone_token[0]), r
        np.testing.assert_allclose(logprobs[r], alone_logprob[0], rtol=1e-6)


def test_a_tiny_temperature_is_greedy_not_nan():
    logits = jnp.asarray(np.random.default_rng(3).standard_normal((2, 50)) * 5, jnp.float32)
    inputs = rows(2, temperature=[1e-38, 1e-6], seed=[1, 2])
    tokens, logprobs = sample_jit(logits, inputs)
    assert np.asarray(tokens).tolist() == np.asarray(logits.argmax(-1)).tolist()
    assert np.isfinite(np.asarray(logprobs)).all()


def test_banned_tokens_are_never_sampled_and_logprobs_stay_raw():
    logits = np.tile(HAND_LOGITS, (TRIALS, 1))
    top, second = int(HAND_ORDER[0]), int(HAND_ORDER[1])
    inputs = rows(TRIALS, seed=np.arange(TRIALS), position=3, banned=[top])
    tokens, logprobs = sample_jit(logits, inputs)
    tokens = np.asarray(tokens)
    assert top not in tokens
    weights = HAND_PROBS.copy()[np.argsort(HAND_ORDER)]  # probability by token id
    weights[top] = 0
    assert_frequencies(tokens, weights / weights.sum())
    np.testing.assert_allclose(logprobs, log_softmax(HAND_LOGITS[None], np.array([1.0]))[0][tokens], atol=1e-5)
    # Greedy takes the best token that is not banned; other rows of the batch are untouched.
    mixed = rows(3, temperature=0.0, banned=[top, 99])
    mixed = mixed._replace(banned=mixed.banned.at[1].set(NO_TOKEN))
    greedy, _ = sample_jit(logits[:3], mixed)
    assert np.asarray(greedy).tolist() == [second, top, second]


def test_ids_logprobs_are_each_rows_logprob_distribution_at_those_ids():
    """token_ids_logprob: the same distribution as the row's own logprob: T-scaled, raw, or the
    processed cut renormalized (-inf outside it); zeros past the asked ids and for rows asking none."""
    logits = random_logits(8, VOCAB, seed=11)
    asked = [999, 0, 5, 500]
    temperature = [0.7, 1.3, 0.9, 1.0, 0.0, 1.0, 1.0, 1.0]
    inputs = rows(8, temperature=temperature, top_k=[0, 0, 40, 0, 0, 0, 0, 0], seed=3, ids=asked,
                  raw_logprobs=[False, True, False, False, False, False, False, False],
                  processed_logprobs=[False, False, True, False, False, False, False, False])
    inputs = inputs._replace(ids=inputs.ids.at[3].set(NO_TOKEN))  # row 3 asks none
    out = jax.jit(sample)(logits, inputs)
    got = np.asarray(out.ids_logprobs)
    x = logits.astype(np.float64)

    def log_softmax(v):
        v = v - v.max(-1, keepdims=True)
        return v - np.log(np.exp(v).sum(-1, keepdims=True))

    np.testing.assert_allclose(got[0, :4], log_softmax(x[0] / 0.7)[asked], atol=1e-5)
    np.testing.assert_allclose(got[1, :4], log_softmax(x[1])[asked], atol=1e-5)
    kept = np.argsort(-x[2])[:40]
    cut = np.full(VOCAB, -np.inf)
    cut[kept] = log_softmax(x[2, kept] / 0.9)
    np.testing.assert_allclose(got[2, :4], cut[asked], atol=1e-5)
    assert not got[3].any() and not got[:, 4:].any()
    np.testing.assert_allclose(got[4, :4], log_softmax(x[4])[asked], atol=1e-5)  # greedy: T = 1
    tokens, logprobs = np.asarray(out.tokens), np.asarray(out.logprobs)
    for r in (0, 1, 2):  # the sampled token's own logprob is the same distribution's
        want = {0: log_softmax(x[0] / 0.7), 1: log_softmax(x[1]), 2: cut}[r][tokens[r]]
        assert abs(logprobs[r] - want) < 1e-5
