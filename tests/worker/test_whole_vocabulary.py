"""server.max_logprobs past the fixed width (-1: the whole vocabulary): the wide sampler and prompt
scorer (executables.py) return every token's logprob, and for the tokens the fixed width returns too
the very same floats, so a request asking 5 and one asking -1 agree to the bit.

The wide engine borrows the session engine's compiled forward passes and fixed-width pieces (same
shapes: what differs is only the wide tables), so only its wide pieces compile here, on first use.
"""

import numpy as np
from flax import nnx

from jaxstream import protocol
from jaxstream.arrays import from_wire
from tests.worker.conftest import BUCKETS, NUM_PAGES, PAGE_SIZE, TINY
from tests.worker.test_engine import PROMPTS, drive
from tests.worker.test_logprobs import distribution
from worker_svc.engine import Engine
from worker_svc.models.llama import Llama

SP = protocol.SamplingParams
V = TINY.vocab


def wide_engine(engine: Engine, max_logprobs: int) -> Engine:
    wide = Engine(Llama(TINY, rngs=nnx.Rngs(0)), BUCKETS, PAGE_SIZE, NUM_PAGES, max_logprobs=max_logprobs)
    for table in ("forwards", "samplers", "penalizers", "scorers", "maskers"):
        setattr(wide.executables, table, getattr(engine.executables, table))
    return wide


def test_only_a_cap_past_the_fixed_width_compiles_wide_pieces(engine):
    assert engine.executables.wide == 0  # the default, server.max_logprobs 20
    assert not engine.executables.wide_samplers and not engine.executables.wide_scorers
    assert wide_engine(engine, 20).executables.wide == 0
    assert wide_engine(engine, 50).executables.wide == 50
    assert wide_engine(engine, 5000).executables.wide == 5000  # past V: V of them (top_count)


def test_whole_vocabulary_logprobs_extend_the_fixed_widths_bit_for_bit(engine):
    wide = wide_engine(engine, -1)
    prompt = PROMPTS["r1"][:12]
    sampling = dict(max_new_tokens=4, temperature=0.8, seed=3, ignore_eos=True, prompt_logprobs_from=0)
    requests = {"narrow": SP(top_logprobs=5, prompt_top_logprobs=20, **sampling),
                "all": SP(top_logprobs=V, prompt_top_logprobs=V, **sampling)}
    narrow, _ = drive(engine, [("a", prompt, requests["narrow"])])
    every, _ = drive(wide, [("a", prompt, requests["all"])])
    a, b = narrow["a"], every["a"]
    assert a.tokens == b.tokens and a.logprobs == b.logprobs  # the same floats
    for token, logprob, logits, ids, lps, few_ids, few_lps in zip(b.tokens, b.logprobs, b.logits, b.top_ids, b.top_logprobs,
                                                                   a.top_ids, a.top_logprobs):
        assert sorted(ids) == list(range(V)) and (np.diff(lps) <= 0).all()  # every token, best first
        np.testing.assert_array_equal(ids[:5], few_ids[:5])
        np.testing.assert_array_equal(lps[:5], few_lps[:5])  # bit for bit
        np.testing.assert_allclose(lps, distribution(np.asarray(logits, np.float64), requests["all"])[ids], atol=1e-5)
        assert lps[list(ids).index(token)] == np.float32(logprob)
    (few,), (all_,) = a.scores, b.scores
    few_ids, few_lps, ids, lps = (from_wire(x) for x in (few.top_ids, few.top_logprobs, all_.top_ids, all_.top_logprobs))
    assert ids.shape == (len(prompt), V)
    np.testing.assert_array_equal(few.logprobs, all_.logprobs)
    np.testing.assert_array_equal(ids[:, :20], few_ids[:, :20])  # position 0's row: -1s, NaNs
    np.testing.assert_array_equal(lps[:, :20], few_lps[:, :20])
    assert all(sorted(row) == list(range(V)) for row in ids[1:])
    assert wide.executables.wide_samplers and wide.executables.wide_scorers  # they ran
