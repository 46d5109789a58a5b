"""The JAX engine on a tiny random Llama, driven by the real scheduler core: the paged cache gives
what a full recompute gives, batches and splits change nothing, nothing compiles after start-up,
and the cache is updated in place."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxstream import protocol
from tests.worker.conftest import BUCKETS, NUM_PAGES, PAGE_SIZE, TINY, tiny_engine
from tests.worker.driver import Driver
from tests.worker.hlo_check import full_copies
from worker_svc.batch import Buckets
from worker_svc.compiles import counter
from worker_svc.engine import Engine
from worker_svc.inputs import StepInputs
from worker_svc.models.llama import Llama

GREEDY = protocol.SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
rng = np.random.default_rng(7)
PROMPTS = {f"r{i}": rng.integers(0, TINY.vocab, n).tolist() for i, n in enumerate([3, 9, 17, 30, 1, 44, 5, 12])}


def drive(engine, requests, budget=16, max_running=8, keep_logits=True):
    driver = Driver(engine, PAGE_SIZE, NUM_PAGES, budget, max_running, keep_logits)
    return driver.run(requests), driver


def recompute(engine, prompt, generated):
    """Logits after each generated token's prefix, each from a fresh prefill (no cached context)."""
    out = []
    for n in range(len(generated)):
        seq = prompt + generated[:n]
        sampling = protocol.SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        traces, _ = drive(engine, [("x", seq, sampling)], budget=64)
        out.append(traces["x"].logits[0])
    return out


def test_decode_through_the_paged_cache_equals_a_full_recompute(engine):
    prompt = PROMPTS["r5"]  # 44 tokens: a chunked prefill over three steps at budget 16
    traces, driver = drive(engine, [("a", prompt, GREEDY)])
    assert sum(s.seqs[0].num_tokens > 1 for s in driver.steps) == 3
    generated = traces["a"].tokens
    reference = recompute(tiny_engine(Buckets((64,), (0,), 8, 24)), prompt, generated)
    for got, want in zip(traces["a"].logits, reference):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_request_gives_the_same_tokens_alone_and_in_any_batch(engine):
    alone = {rid: drive(engine, [(rid, p, GREEDY)])[0][rid] for rid, p in PROMPTS.items()}
    together, driver = drive(engine, [(rid, p, GREEDY) for rid, p in PROMPTS.items()], budget=16)
    assert max(len(s.seqs) for s in driver.steps) > 4  # really batched, prefill mixed with decode
    for rid in PROMPTS:
        assert together[rid].tokens == alone[rid].tokens, rid
        np.testing.assert_allclose(together[rid].logprobs, alone[rid].logprobs, atol=1e-5)


def test_a_step_larger_than_every_bucket_runs_as_sub_steps_with_the_same_result(engine):
    requests = [(rid, p, GREEDY) for rid, p in PROMPTS.items()]
    small, _ = drive(engine, requests, budget=64)  # steps of up to 64 tokens on buckets of <= 16
    big = tiny_engine(Buckets((64,), (0, 256), 8, 24))
    whole, _ = drive(big, requests, budget=64)
    for rid in PROMPTS:
        assert small[rid].tokens == whole[rid].tokens, rid
        np.testing.assert_allclose(small[rid].logits, whole[rid].logits, atol=1e-5)


def test_page_lists_and_pairs_read_the_same_cache(engine):
    """The two attention layouts (layers/attention.py) agree: every step through page lists, and the
    shared engine's mix (lists up to 4 tokens, pairs for 8 and 16), on prefill mixed with decode
    over contexts of 1 to 14 pages."""
    requests = [(rid, p, GREEDY) for rid, p in PROMPTS.items()]
    mixed, _ = drive(engine, requests)
    lists, _ = drive(tiny_engine(dataclasses.replace(BUCKETS, page_list_tokens=16)), requests)
    for rid in PROMPTS:
        assert lists[rid].tokens == mixed[rid].tokens, rid
        np.testing.assert_allclose(lists[rid].logits, mixed[rid].logits, atol=1e-5)


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(engine):
    seeded = protocol.SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = drive(engine, [("s", PROMPTS["r3"], seeded)])[0]["s"].tokens
    again = drive(engine, [("s", PROMPTS["r3"], seeded)])[0]["s"].tokens
    busy = [(rid, p, protocol.SamplingParams(max_new_tokens=16, temperature=0.8, top_k=20, ignore_eos=True)) for rid, p in PROMPTS.items()]
    in_batch = drive(engine, [*busy[:4], ("s", PROMPTS["r3"], seeded), *busy[4:]])[0]["s"].tokens
    other_seed = drive(engine, [("s", PROMPTS["r3"], protocol.SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True))])[0]["s"].tokens
    assert alone == again == in_batch
    assert other_seed != alone


def test_nothing_compiles_after_start_up_under_a_mixed_workload(engine):
    before = counter().count
    mixed = [(rid, p, protocol.SamplingParams(max_new_tokens=3 + i, temperature=0.0 if i % 2 else 0.7, ignore_eos=True))
             for i, (rid, p) in enumerate(PROMPTS.items())]
    for budget, running in ((16, 8), (5, 3), (16, 1)):
        drive(engine, mixed, budget=budget, max_running=running, keep_logits=False)
    drive(engine, [("long", PROMPTS["r5"] * 2, GREEDY)], budget=16)  # 88 prompt tokens: 22 pages of context
    assert counter().count == before  # the process-wide count: what the worker reports as stats
    assert len(engine.executables.forwards) == len(BUCKETS.shapes())


def test_the_step_updates_the_kv_cache_in_place(engine):
    cache_elems = engine.cache.k.size
    for shape, executable in engine.executables.forwards.items():  # every compiled shape: one-token steps copied
        hlo = executable.as_text()
        header = hlo.splitlines()[0]
        # The cache's two arrays are aliased to outputs (donated) and nothing copies one.
        assert header.count("may-alias") >= 2, (shape, header)
        assert full_copies(hlo, cache_elems) == [], shape

    # The detector does see a copy: reading a donated cache after writing it forces one.
    def read_after_write(cache, x):
        return cache.at[0, 0].set(x), cache.sum()

    bad = jax.jit(read_after_write, donate_argnums=0).lower(engine.cache.k, jnp.zeros(engine.cache.k.shape[2:])).compile()
    assert full_copies(bad.as_text(), cache_elems)


def test_a_cache_of_one_kv_head_is_updated_in_place_too():
    """A cache axis of size 1 (one KV head: multi-query attention, or a tensor-parallel shard of as
    many KV heads as devices): writing through a reshape of the cache, XLA:CPU laid the result out
    with that axis moved and copied it back, twice per array and step (230 ms a decode step of 30
    tiny layers, 1.3 ms without the copies)."""
    mqa = Engine(Llama(dataclasses.replace(TINY, kv_heads=1), rngs=nnx.Rngs(0)), BUCKETS, PAGE_SIZE, NUM_PAGES)
    for shape in [(1, 0, BUCKETS.max_pages), (4, 0, BUCKETS.max_pages), (16, 64, 0)]:
        assert full_copies(mqa.executables.lower_forward(shape).compile().as_text(), mqa.cache.k.size) == [], shape


@pytest.mark.parametrize("shape", [(1, 0, BUCKETS.max_pages), (2, 0, 0), (4, 0, BUCKETS.max_pages), (16, 64, 0)])
def test_padding_tokens_pairs_and_page_lists_write_nothing(engine, shape):
    before = (np.asarray(engine.cache.k).copy(), np.asarray(engine.cache.v).copy())
    t, w, o = shape
    padded = StepInputs.padded(t, w, o, BUCKETS.rows(t), NUM_PAGES * PAGE_SIZE)
    _, _, engine.cache = engine.executables.forwards[shape](engine.params, engine.cache, padded, engine.last)
    np.testing.assert_array_equal(np.asarray(engine.cache.k), before[0])
    np.testing.assert_array_equal(np.asarray(engine.cache.v), before[1])


def test_bfloat16_parameters_and_cache_follow_float32():
    """worker.dtype=bfloat16 (for GPU/TPU): same code path, bf16 weights and cache, float32 logits."""
    f32 = tiny_engine()
    bf16 = Engine(Llama(TINY, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), BUCKETS, PAGE_SIZE, NUM_PAGES)
    assert bf16.cache.k.dtype == jnp.bfloat16
    requests = [(rid, PROMPTS[rid], protocol.SamplingParams(max_new_tokens=1, temperature=0.0)) for rid in ("r1", "r3")]
    a, _ = drive(f32, requests)
    b, _ = drive(bf16, requests)
    for rid, _, _ in requests:
        assert b[rid].logits[0].dtype == np.float32
        np.testing.assert_allclose(b[rid].logits[0], a[rid].logits[0], atol=0.05)


def test_a_bfloat16_cache_under_float32_weights_decodes_as_its_own_full_recompute_and_follows_float32(engine):
    """worker.kv_cache_dtype=bfloat16: the cache holds bfloat16's bits (half the bytes); a chunked
    prefill and decode through it equal a fresh prefill of each prefix (every key rounded alike,
    whichever step wrote it), serve the same again after a release and resume of the cache, and
    stay near a float32 cache's logits."""
    bf16 = Engine(Llama(TINY, rngs=nnx.Rngs(0)), BUCKETS, PAGE_SIZE, NUM_PAGES, kv_cache_dtype="bfloat16")
    assert bf16.cache.k.dtype == jnp.uint16
    assert bf16.cache.k.shape == (TINY.layers, NUM_PAGES, PAGE_SIZE, TINY.kv_heads, TINY.head_dim)
    prompt = PROMPTS["r5"]  # a chunked prefill over three steps at budget 16
    sampling = protocol.SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    traces, _ = drive(bf16, [("a", prompt, sampling)])
    generated = traces["a"].tokens
    one_step = Engine(Llama(TINY, rngs=nnx.Rngs(0)), Buckets((64,), (0,), 8, 24), PAGE_SIZE, NUM_PAGES, kv_cache_dtype="bfloat16")
    for got, want in zip(traces["a"].logits, recompute(one_step, prompt, generated)):
        np.testing.assert_allclose(got, want, atol=1e-5)
    for shape, executable in bf16.executables.forwards.items():  # the one-token decode among them: written in place too
        assert full_copies(executable.as_text(), bf16.cache.k.size) == [], shape
    assert any(shape[0] == 1 for shape in bf16.executables.forwards)
    bf16.release({"kv_cache"})
    bf16.resume_kv_cache()  # the same storage again, from the compiled empty cache
    assert bf16.cache.k.dtype == jnp.uint16
    again = drive(bf16, [("a", prompt, sampling)])[0]["a"]
    assert again.tokens == generated and np.array_equal(np.stack(again.logits), np.stack(traces["a"].logits))
    f32 = drive(engine, [("a", prompt, sampling)])[0]["a"]  # the same weights, a float32 cache
    np.testing.assert_allclose(traces["a"].logits[0], f32.logits[0], atol=0.02)
    assert not np.array_equal(traces["a"].logits[0], f32.logits[0])


def test_stop_tokens_are_held_back_until_min_new_tokens(engine):
    free = drive(engine, [("a", PROMPTS["r2"], GREEDY)])[0]["a"].tokens
    stop = free[0]  # what greedy says first: make it a stop token
    held = protocol.SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(stop,), min_new_tokens=6)
    traces, driver = drive(engine, [("a", PROMPTS["r2"], held), ("b", PROMPTS["r4"], GREEDY)])
    out = traces["a"].tokens
    assert stop not in out[:6] and out[0] != free[0]
    assert len(out) >= 7  # six tokens, then a stop token may end it
    banned_steps = [s for s in driver.steps for q in s.seqs if q.rid == "a" and q.banned]
    assert len(banned_steps) == 6 and all(q.banned == (stop,) for s in banned_steps for q in s.seqs if q.rid == "a")
    assert all(not q.banned for s in driver.steps for q in s.seqs if q.rid == "b")


def test_overlap_decodes_follow_the_tokens_in_flight_with_the_same_results(engine):
    """Steps planned before the previous step's result (scheduler.overlap): a decode's input token
    is read on the device from its slot, penalties count it from the read-back; every token,
    logprob and logit is what one step at a time gives, and a stop token ends on time."""
    free = drive(engine, [("g", PROMPTS["r2"], GREEDY)])[0]["g"].tokens
    kinds = [
        GREEDY,
        protocol.SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
        protocol.SamplingParams(max_new_tokens=12, temperature=0.8, seed=6, repetition_penalty=1.4, frequency_penalty=0.6,
                                presence_penalty=0.3, ignore_eos=True),
        protocol.SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(free[3],)),
        protocol.SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(free[0],), min_new_tokens=2),
    ]
    requests = [(rid, PROMPTS["r2"] if i % len(kinds) >= 3 else p, kinds[i % len(kinds)]) for i, (rid, p) in enumerate(PROMPTS.items())]
    results = {}
    for overlap in (False, True):
        driver = Driver(engine, PAGE_SIZE, NUM_PAGES, 16, 8, keep_logits=True, overlap=overlap)
        results[overlap] = driver.run(requests)
        follows = sum(q.follows for s in driver.steps for q in s.seqs)
        assert (follows > 20) == overlap, follows
    for rid, _, _ in requests:
        one, ahead = results[False][rid], results[True][rid]
        assert ahead.tokens == one.tokens, rid
        np.testing.assert_allclose(ahead.logprobs, one.logprobs, atol=1e-5)
        np.testing.assert_allclose(ahead.logits, one.logits, atol=1e-5)
    assert results[True]["r3"].tokens == free[:4]  # stopped on its stop token
