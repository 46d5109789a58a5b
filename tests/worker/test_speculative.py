"""Speculative decoding (scheduler.speculative=ngram) on the JAX engine and the real scheduler core:
verifying n-gram drafts changes how many steps a request takes, never what it gets. Greedy and
seeded sampled requests, with penalties, alternatives and stop tokens, get the tokens, logprobs and
logits of decoding one token a step (the default numerics: to 1e-5, as any two batches; bit for bit
under batch_invariant, test_batch_invariant.py); unseeded sampled ones, the same distribution."""

import numpy as np
import pytest

from jaxstream import protocol
from scheduler_svc.ngram import NgramDrafter
from tests.worker.conftest import NUM_PAGES, PAGE_SIZE, TINY
from tests.worker.driver import Driver

rng = np.random.default_rng(3)
BLOCK = rng.integers(0, TINY.vocab, 12).tolist()
PROMPTS = {"repeats": BLOCK * 3, "random": rng.integers(0, TINY.vocab, 20).tolist(), "quotes": BLOCK + BLOCK[:5]}
KINDS = {
    "greedy": protocol.SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True),
    "seeded": protocol.SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True),
    "penalized": protocol.SamplingParams(max_new_tokens=24, temperature=0.8, seed=6, repetition_penalty=1.4, frequency_penalty=0.6,
                                         presence_penalty=0.3, ignore_eos=True, top_logprobs=3),
}
DRAFTER = NgramDrafter(4, 1, 3)


def run(engine, requests, drafter=None, overlap=False):
    driver = Driver(engine, PAGE_SIZE, NUM_PAGES, 16, 8, keep_logits=True, overlap=overlap, drafter=drafter)
    return driver.run(requests), driver


@pytest.mark.parametrize("overlap", [False, True])
def test_drafts_change_the_steps_not_the_tokens_logprobs_or_logits(engine, overlap):
    accepted = 0
    for name, prompt in PROMPTS.items():  # a prompt's requests at a time: 8 sampled rows a step leave room for drafts
        requests = [(f"{name}-{k}", prompt, s) for k, s in KINDS.items()]
        plain, _ = run(engine, requests)
        if name == "repeats":  # a stop token its greedy request samples, to end a draft's tokens in their middle
            stop = plain["repeats-greedy"].tokens[9]
            requests.append(("stops", prompt, protocol.SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=(stop,))))
            plain["stops"] = run(engine, requests[-1:])[0]["stops"]
            assert len(plain["stops"].tokens) == plain["repeats-greedy"].tokens.index(stop) + 1
        drafted, driver = run(engine, requests, DRAFTER, overlap)
        accepted += driver.scheduler.core.stats()["spec_decode_num_accepted_tokens_total"]
        for rid, _, _ in requests:
            one, many = plain[rid], drafted[rid]
            assert many.tokens == one.tokens, rid
            np.testing.assert_allclose(many.logprobs, one.logprobs, atol=1e-5, err_msg=rid)
            np.testing.assert_allclose(np.array(many.logits), np.array(one.logits), atol=1e-5, err_msg=rid)
            if rid.endswith("penalized"):
                assert np.array_equal(np.array(many.top_ids), np.array(one.top_ids)), rid
                np.testing.assert_allclose(np.array(many.top_logprobs), np.array(one.top_logprobs), atol=1e-5)
    assert accepted >= 15, accepted


# Chi-squared critical values at p = 0.001, by degrees of freedom (1..9)
CHI2_0001 = (10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88)


def chi2_two_samples(a: list[int], b: list[int]) -> tuple[float, int]:
    """Pearson's statistic of a 2 x k table of two samples' categories (those expected fewer than 5
    times in either pooled), and its degrees of freedom."""
    cats = sorted(set(a) | set(b))
    table = np.array([[x.count(c) for c in cats] for x in (a, b)], float)
    rare = table.sum(0) < 10
    table = np.concatenate([table[:, ~rare], table[:, rare].sum(1, keepdims=True)], axis=1) if rare.any() else table
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum()), table.shape[1] - 1


def test_unseeded_sampling_keeps_its_distribution(engine):
    """A draft token is accepted where the sampled token equals it (drafts.py), so the tokens of
    unseeded requests (each its own seed) follow plain decoding's distribution: 240 requests each
    way (other rids: other seeds), their second to fourth tokens compared by a chi-squared test.
    Deterministic: fixed rids."""
    # The prompt ends in the loop greedy decoding falls into: drafts guess the likelier token, and
    # are accepted about as often as it is sampled
    greedy = protocol.SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    prompt = PROMPTS["repeats"] + run(engine, [("loop", PROMPTS["repeats"], greedy)])[0]["loop"].tokens
    sampling = protocol.SamplingParams(max_new_tokens=4, temperature=1.0, top_k=2, ignore_eos=True)
    plain, drafted, drafts, accepted = {}, {}, 0, 0
    for first in range(0, 240, 4):  # 4 at a time: a step's 8 sampled rows leave room for drafts
        plain |= run(engine, [(f"plain-{i}", prompt, sampling) for i in range(first, first + 4)])[0]
        traces, driver = run(engine, [(f"drafted-{i}", prompt, sampling) for i in range(first, first + 4)], DRAFTER)
        drafted |= traces
        drafts += driver.scheduler.core.stats()["spec_decode_num_drafts_total"]
        accepted += driver.scheduler.core.stats()["spec_decode_num_accepted_tokens_total"]
    assert drafts >= 200 and accepted >= 60, (drafts, accepted)  # accepted about half the time
    for position in (1, 2, 3):
        statistic, df = chi2_two_samples([t.tokens[position] for t in plain.values()], [t.tokens[position] for t in drafted.values()])
        print(f"output token {position + 1}: chi-squared {statistic:.2f}, {df} degrees of freedom")  # pytest -s
        assert 1 <= df <= len(CHI2_0001) and statistic < CHI2_0001[df - 1], (position, statistic, df)
