"""A hybrid's recurrent states through a request's lifecycle, on the tiny Qwen3.5 (qwen3_5_tiny:
three Gated DeltaNet layers, one full-attention layer, random weights), the scheduler core and the
JAX engine in one process (stack/driver.py). A state row is never cleared: a row at position 0
starts from zeros (worker_svc/layers/delta_net.py). So each of these must give the tokens and logits
a request gets alone on a fresh engine:
- a slot another request used before (its row holds that request's last state);
- a request retracted for pages, which re-prefills from position 0 in whatever slot it gets;
- a request paused in place (its slot, pages and state kept) and continued: it decodes on, with no
  re-prefill;
- after the KV cache's memory is released and resumed (the states are released with the pages and
  come back as zeros), and after a weight update (the same weights staged again and committed)."""

import numpy as np
import pytest

from jaxstream import protocol
from jaxstream.config import load_config
from tests.worker.driver import Driver
from worker_svc.batch import Buckets
from worker_svc.engine import Engine
from worker_svc.loading import load_model, open_model

PAGE_SIZE, SLOTS, BUDGET = 16, 4, 16
GREEDY = protocol.SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = {"a": [(7 * i + 3) % 900 for i in range(37)], "b": [(11 * i + 5) % 900 for i in range(21)],
           "c": [(13 * i + 1) % 900 for i in range(45)]}
CONFIG = load_config(["model=qwen3_5_tiny", "scheduler.prefix_cache=false"])


@pytest.fixture(scope="module")
def engine() -> Engine:
    """Compiled lazily, per shape the tests use (the pool is the driver's own: each test's Driver
    counts pages in these 64)."""
    model = load_model(open_model(CONFIG.model, dummy=True), dummy=True, progress=False)
    return Engine(model, Buckets(tokens=(4, 16), pairs=(0, 16, 64), max_rows=SLOTS, max_pages=8), PAGE_SIZE, 64)


def run(engine: Engine, rids: list[str], num_pages: int = 64) -> tuple[dict, Driver]:
    driver = Driver(engine, PAGE_SIZE, num_pages, budget=BUDGET, max_running=SLOTS, keep_logits=True, state_slots=True)
    return driver.run([(rid, PROMPTS[rid], GREEDY) for rid in rids]), driver


def assert_alike(got, want) -> None:
    assert got.tokens == want.tokens
    np.testing.assert_allclose(np.stack(got.logits), np.stack(want.logits), atol=1e-4)


@pytest.fixture(scope="module")
def alone(engine) -> dict:
    """Each request alone, the first on the fresh engine's zeros, each later one in the slot (0) the
    one before it used: a reused slot starts clean, else they would differ from `test_...` below."""
    return {rid: run(engine, [rid])[0][rid] for rid in PROMPTS}


def test_a_reused_slot_and_a_retracted_request_start_clean(engine, alone):
    crowded, driver = run(engine, list(PROMPTS), num_pages=7)  # 3 requests of 3 to 4 pages each: one is retracted
    assert driver.scheduler.core.counters.preempted_total > 0
    for rid in PROMPTS:
        assert_alike(crowded[rid], alone[rid])
    assert driver.scheduler.core.stats()["state_slots_used"] == 0


def test_an_in_place_pause_keeps_the_state_and_decodes_on(engine, alone):
    driver = Driver(engine, PAGE_SIZE, 64, budget=BUDGET, max_running=SLOTS, state_slots=True)
    rule = protocol.FinishRule((), GREEDY.max_new_tokens, 0)
    driver.submit(protocol.TokenizedRequest("a", "gw", tuple(PROMPTS["a"]), GREEDY, finish=rule))
    tokens = []

    def steps(count: int = 10_000) -> None:
        for _ in range(count):
            result = driver.step()
            if result is None:
                return
            tokens.extend(token for rid, token in zip(result.rids, result.token_ids) if rid == "a")

    steps(5)  # the prompt's three chunks, then decodes
    driver.inbox.append(protocol.PauseGeneration("p", "gw", "in_place"))
    steps()  # what was in flight, then nothing while paused
    assert 0 < len(tokens) < GREEDY.max_new_tokens
    assert driver.scheduler.core.stats()["state_slots_used"] == 1  # still running, its slot (and state) held
    paused = len(driver.steps)
    driver.inbox.append(protocol.ContinueGeneration("c", "gw"))
    steps()
    after = [q for step in driver.steps[paused:] for q in step.seqs]
    assert after and all(q.num_tokens == 1 for q in after)  # it decodes on: no re-prefill
    assert tokens[:GREEDY.max_new_tokens] == alone["a"].tokens
    assert driver.scheduler.core.stats()["state_slots_used"] == 0


def test_release_resume_and_a_weight_update_start_clean(engine, alone):
    engine.release({"kv_cache"})
    engine.resume_kv_cache()  # the pages and the states again, zeros
    assert not engine.cache.state.any() and not engine.cache.conv.any()
    assert_alike(run(engine, ["a"])[0]["a"], alone["a"])
    engine.stage_dummy(CONFIG.worker.seed)  # the same weights again
    engine.commit_weights()
    assert_alike(run(engine, ["b"])[0]["b"], alone["b"])
