"""A hybrid of linear and full attention (qwen3_5_tiny: three Gated DeltaNet layers, one gated
full-attention layer, random weights) through the whole stack, one stack for all: 64 concurrent
requests of mixed lengths, some aborted mid-stream, more than its slots and pages hold at once (so
requests queue for a slot, and some are retracted); afterwards every recurrent-state slot and every
page is free (or held by the prefix cache alone). A prompt sent again hits the prefix cache (its
linear layers restarting from a state snapshot) and gives the tokens the miss gave. The official
`openai` client gets a chat answer and the same answer streamed.""" 

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support import generate_then_abort, scheduler_stats, serve, wait_for

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]

SLOTS = 8
# 8 slots over 20 pages of 16 tokens: 8 requests of up to 60 prompt tokens and 24 outputs (up to 6
# pages each) need more pages than that at once, so the scheduler retracts some (each re-prefills from position 0, its
# state row starting clean there)
SMALL = ["model=qwen3_5_tiny", "scheduler.state_snapshots=4", f"scheduler.max_running_requests={SLOTS}",
         "scheduler.max_tokens_per_step=32", "scheduler.num_pages=20", "worker.token_buckets=[8,32]",
         "worker.pair_buckets=[0,32,128]", "model.max_model_len=256"]
REQUESTS, ABORTED_EVERY = 64, 8


@pytest.fixture(scope="module")
def stack(redis_url):
    yield from serve(redis_url, *SMALL)


def generate(base_url: str, prompt: list[int], new_tokens: int) -> dict:
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}
    return httpx.post(base_url + "/generate", json=body, timeout=240).json()


def test_64_concurrent_requests_some_aborted_leave_every_state_slot_and_page_free(stack):
    rng = random.Random(0)
    asks = [([rng.randrange(1, 49152) for _ in range(rng.randrange(1, 61))], rng.randrange(1, 25)) for _ in range(REQUESTS)]

    def one(i: int) -> dict:
        prompt, new_tokens = asks[i]
        if i % ABORTED_EVERY == 0:  # streamed, aborted once 2 tokens came (the helper checks its partial output)
            return generate_then_abort(stack, f"hybrid-abort-{i}", after=2, input_ids=prompt,
                                       sampling_params={"max_new_tokens": 150, "ignore_eos": True})  # within the context
        return generate(stack, prompt, new_tokens)

    with ThreadPoolExecutor(REQUESTS) as pool:
        outs = list(pool.map(one, range(REQUESTS)))
    for i, out in enumerate(outs):
        meta = out["meta_info"]
        if i % ABORTED_EVERY:
            assert (meta["finish_reason"]["type"], len(out["output_ids"])) == ("length", asks[i][1]), out
    [stats] = scheduler_stats(stack)
    assert stats["preempted_total"] > 0  # retraction happened among them
    # idle_after_each_test checks running, waiting and pages after each test; the state slots come
    # back with the requests' slots
    wait_for(lambda: scheduler_stats(stack)[0]["state_slots_used"] == 0, 10, "every state slot to be free")
    [stats] = scheduler_stats(stack)
    assert (stats["state_slots_total"], stats["state_slots_free"]) == (SLOTS, SLOTS)
    assert stats["pages_used"] == stats["pages_evictable"] == stats["pages_cached"]  # the prefix cache's alone, pinned by nobody
    assert stats["state_snapshots_total"] == 4


def test_a_prefix_hit_gives_the_tokens_of_the_miss(stack):
    prompt = [random.Random(1).randrange(1, 49152) for _ in range(50)]  # 3 whole pages and 2 tokens
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
    miss, hit = (httpx.post(stack + "/generate", json=body, timeout=60).json() for _ in range(2))
    assert miss["meta_info"]["cached_tokens"] == 0 and hit["meta_info"]["cached_tokens"] == 48
    assert hit["output_ids"] == miss["output_ids"]


def test_the_openai_client_gets_a_chat_answer_and_the_same_answer_streamed(client):
    model = client.models.list().data[0].id
    asked = dict(model=model, messages=[{"role": "user", "content": "Hello! What is the weather in Paris?"}],
                 temperature=0, max_tokens=12)
    whole = client.chat.completions.create(**asked).choices[0]
    assert whole.message.content and whole.finish_reason == "length"
    chunks = list(client.chat.completions.create(stream=True, **asked))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
