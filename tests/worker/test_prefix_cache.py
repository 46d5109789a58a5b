"""The JAX engine fed only what follows a cached prefix: the same tokens as a full prefill, the
penalties counting the prefix it was not fed (StepSeq.history), on a tiny random Llama."""

import msgspec
import numpy as np
import pytest

from jaxstream import protocol
from scheduler_svc.service import SchedulerService
from tests.worker.conftest import NUM_PAGES, PAGE_SIZE
from tests.worker.driver import Driver

rng = np.random.default_rng(11)
# Few distinct tokens: the prefix holds many of the tokens greedy decoding wants next, so whether
# the penalty counts them changes what is sampled.
SHARED = rng.integers(0, 12, 27).tolist()  # 6 whole pages of 4, and 3 tokens more
PENALIZED = protocol.SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.8,
                                    frequency_penalty=0.3)


def cached_run(engine, rid, prompt, sampling, warm=SHARED + [50]):
    """`prompt` after a request that leaves `warm`'s pages in the prefix cache. (The engine keeps a
    token history by rid: each run needs rids of its own.)"""
    driver = Driver(engine, PAGE_SIZE, NUM_PAGES, 16, 8, prefix_cache=True)
    driver.run([(rid + "-warm", warm, protocol.SamplingParams(max_new_tokens=1, temperature=0.0))])
    traces = driver.run([(rid, prompt, sampling)])
    first = next(q for s in driver.steps for q in s.seqs if q.rid == rid)
    return traces[rid], first


@pytest.mark.parametrize("sampling", [PENALIZED, protocol.SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)])
def test_a_cache_hit_gives_the_tokens_of_a_full_prefill(engine, sampling):
    prompt = SHARED + [60, 61]
    rid = f"penalized-{sampling.uses_penalty()}"
    full = Driver(engine, PAGE_SIZE, NUM_PAGES, 16, 8).run([(rid + "-full", prompt, sampling)])[rid + "-full"]
    cached, first = cached_run(engine, rid, prompt, sampling)
    assert first.context_len - first.num_tokens == 24  # fed from position 24: six pages came from the cache
    assert (first.history is not None) == sampling.uses_penalty()
    assert cached.tokens == full.tokens
    np.testing.assert_allclose(cached.logprobs, full.logprobs, atol=1e-5)


def test_without_the_prefix_history_the_penalties_would_count_too_little(engine, monkeypatch):
    # The check above is not vacuous: dropping StepSeq.history changes this request's tokens.
    prompt = SHARED + [60, 61]
    full = Driver(engine, PAGE_SIZE, NUM_PAGES, 16, 8).run([("control-full", prompt, PENALIZED)])["control-full"]
    to_step = SchedulerService.to_step

    def without_history(self, plan):
        step = to_step(self, plan)
        return msgspec.structs.replace(step, seqs=tuple(msgspec.structs.replace(q, history=None) for q in step.seqs))

    monkeypatch.setattr(SchedulerService, "to_step", without_history)
    cached, _ = cached_run(engine, "control", prompt, PENALIZED)
    assert cached.tokens != full.tokens
