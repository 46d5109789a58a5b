"""The Prometheus families vLLM's dashboards read: the scheduler times a request's phases and counts
its steps' tokens with the clock it is handed (its core reads none), publishes them as cumulative
bucket counts in its stats, and the gateway renders them per replica. Every rendering is parsed by
prometheus_client's own parser."""

import asyncio
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import Metrics
from jaxstream import protocol
from jaxstream.histogram import REQUEST_LATENCY_BUCKETS, Histogram, one_two_five, read
from jaxstream.protocol import FinishReason, FinishRule, SamplingParams
from scheduler_svc.core import Request, Scheduler
from scheduler_svc.pages import PageAllocator
from scheduler_svc.radix import RadixCache

MODEL = "m"


def families(text: bytes) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text.decode())}


def samples(family, **labels) -> dict[str, float]:
    """name{le=...} -> value for the samples of `family` whose labels include `labels`."""
    return {s.name + (f'{{le="{s.labels["le"]}"}}' if "le" in s.labels else ""): s.value
            for s in family.samples if labels.items() <= s.labels.items()}


def test_one_two_five_and_a_histogram_travel_as_two_fields():
    assert one_two_five(100) == (1, 2, 5, 10, 20, 50, 100) and one_two_five(4) == (1, 2)
    h = Histogram((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 9.0):
        h.observe(v)
    stats = h.stats("x")
    assert stats == {"x_buckets": (2, 3, 4), "x_sum": 12.0}  # le: 1.0 holds 0.5 and 1.0
    assert read(SimpleNamespace(**stats), "x", (1.0, 2.0)) == ([2, 3, 4], 12.0)
    assert read(SimpleNamespace(**stats), "x", (1.0,)) is None  # kept with other bounds


def test_the_core_times_phases_with_the_clock_it_is_given():
    pages = PageAllocator(16)
    s = Scheduler(max_running=1, token_budget=4, page_size=2, allocator=pages, cache=RadixCache(2, pages))
    fin = FinishRule((), 2, 0)
    a = Request("a", "g", [1, 2, 3, 4, 5, 6], SamplingParams(), fin, arrived=10.0)
    b = Request("b", "g", [1, 2, 3, 4, 7], SamplingParams(), fin, arrived=10.0)
    s.add(a)
    s.add(b)
    p1 = s.plan(now=11.0)  # a's first chunk: 4 of 6 prompt tokens
    s.absorb(p1, {}, now=11.5)
    p2 = s.plan(now=12.0)  # a's last 2: samples
    s.absorb(p2, {"a": (9, 0.0)}, now=13.0)  # a's first token
    p3 = s.plan(now=13.0)
    assert s.absorb(p3, {"a": (9, 0.0)}, now=16.0)  # a ends: 2 tokens; b has waited since 10
    p4 = s.plan(now=17.0)  # b: its first 4 tokens from the cache, its last fed
    s.absorb(p4, {"b": (9, 0.0)}, now=18.0)
    s.finish("b", now=18.5)  # a stop string
    st = s.stats()
    c = s.counters
    assert [c.request_queue_time_seconds.sum, c.request_prefill_time_seconds.sum,
            c.request_decode_time_seconds.sum, c.request_inference_time_seconds.sum] == [1 + 7, 2 + 1, 3 + 0.5, 5 + 1.5]
    sent = protocol.SchedulerStats(**st, waiting_deferred=0)
    assert read(sent, "request_queue_time_seconds", REQUEST_LATENCY_BUCKETS)[0][-1] == 2
    # vLLM's iteration tokens, per step's result: 0 (a's first chunk), 6 + 1 (a's whole prompt with its
    # first token), 1 (a's decode), 5 + 1 (b's whole prompt, cached part included, with its first token).
    assert (c.iteration_tokens_total.sum, sum(c.iteration_tokens_total.counts)) == (14, 4)
    assert (st["prefix_cache_queries_total"], st["prefix_cache_hits_total"], st["page_size"], st["prefix_cache"]) == (11, 4, 2, 1)
    s.add(Request("c", "g", [5], SamplingParams(), fin, arrived=19.0))
    s.plan(now=20.0)
    s.abort("c")  # an abort is no finish: not observed
    assert sum(s.counters.request_queue_time_seconds.counts) == 2


def replica_stats(**extra) -> protocol.SchedulerStats:
    """A scheduler's stats as the gateway reads them, after one request."""
    pages = PageAllocator(8)
    s = Scheduler(max_running=2, token_budget=8, page_size=4, allocator=pages)
    s.add(Request("a", "g", [1, 2, 3], SamplingParams(), FinishRule((), 1, 0), arrived=0.0))
    s.absorb(s.plan(now=0.2), {"a": (5, 0.0)}, now=0.9)
    return protocol.SchedulerStats(**{**s.stats(), "waiting_deferred": 0, **extra})


def test_render_labels_each_replica_and_parses():
    metrics = Metrics(MODEL, replicas=3, max_model_len=1000)
    up0 = replica_stats(waiting=3, waiting_deferred=2, preempted_total=4, spec_decode_num_draft_tokens_total=8,
                        spec_decode_num_accepted_tokens_total=6)
    text = metrics.render([(0, up0), (1, replica_stats())])  # replica 2 is down
    f = families(text)
    p = "jaxstream:"
    assert f[p + "num_preemptions"].type == "counter" and f[p + "prefix_cache_queries"].type == "counter"
    assert samples(f[p + "num_preemptions"], replica="0") == {p + "num_preemptions_total": 4.0}
    assert samples(f[p + "spec_decode_num_draft_tokens"], replica="1") == {p + "spec_decode_num_draft_tokens_total": 0.0}
    assert samples(f[p + "spec_decode_acceptance_rate"], replica="1") == {p + "spec_decode_acceptance_rate": 0.0}
    assert samples(f[p + "spec_decode_acceptance_rate"], replica="0") == {p + "spec_decode_acceptance_rate": 0.75}
    assert not samples(f[p + "num_preemptions"], replica="2")  # down: no series until it is back
    waiting = samples(f[p + "num_requests_waiting"], replica="2")
    assert waiting == {p + "num_requests_waiting": 0.0}  # the load gauges read 0
    by_reason = {s.labels["reason"]: s.value for s in f[p + "num_requests_waiting_by_reason"].samples
                 if s.labels["replica"] == "0"}
    assert by_reason == {"capacity": 1.0, "deferred": 2.0}
    (info,) = [s for s in f[p + "cache_config_info"].samples if s.labels["replica"] == "1"]
    assert [info.labels[k] for k in ("block_size", "num_gpu_blocks", "enable_prefix_caching")] == ["4", "8", "False"]
    assert info.value == 1.0
    queue = samples(f[p + "request_queue_time_seconds"], replica="0", model_name=MODEL)
    assert queue[p + 'request_queue_time_seconds_bucket{le="0.3"}'] == 1.0  # 0.2 s
    assert queue[p + "request_queue_time_seconds_count"] == 1.0 and queue[p + "request_queue_time_seconds_sum"] == 0.2
    prefill = samples(f[p + "request_prefill_time_seconds"], replica="1")
    assert prefill[p + 'request_prefill_time_seconds_bucket{le="0.5"}'] == 0.0  # 0.7 s
    assert prefill[p + 'request_prefill_time_seconds_bucket{le="0.8"}'] == 1.0
    iteration = samples(f[p + "iteration_tokens_total"], replica="0")
    assert iteration[p + "iteration_tokens_total_count"] == 1 and iteration[p + "iteration_tokens_total_sum"] == 3 + 1  # prompt and token
    buckets = [s.labels["le"] for s in f[p + "request_inference_time_seconds"].samples
               if s.name.endswith("_bucket") and s.labels["replica"] == "0"]
    assert buckets == [*(repr(b) for b in REQUEST_LATENCY_BUCKETS), "+Inf"]  # vLLM's bounds


def outputs(tokens: list[int], finish_after: int):
    """A request's outputs as the gateway receives them: one token each, the last one finishing."""
    async def gen():
        for i, t in enumerate(tokens):
            done = i == finish_after
            finish = FinishReason("length", length=i + 1) if done else None
            yield protocol.RequestOutput("r", token_ids=(t,), finish=finish, prompt_tokens=7)
    return gen()


def test_the_gateway_observes_token_counts_and_a_prompts_n_samples_once():
    metrics = Metrics(MODEL, max_model_len=100)

    async def run():
        group = metrics.group(2, 50)
        for n in (3, 5):
            async for _ in metrics.track(outputs(list(range(n)), n - 1), group):
                pass
    asyncio.run(run())
    f = families(metrics.render([]))
    p = "jaxstream:"
    gen = samples(f[p + "request_generation_tokens"])
    assert gen[p + "request_generation_tokens_count"] == 2 and gen[p + "request_generation_tokens_sum"] == 8
    assert samples(f[p + "request_prompt_tokens"])[p + "request_prompt_tokens_sum"] == 14
    most = samples(f[p + "request_max_num_generation_tokens"])
    assert most[p + "request_max_num_generation_tokens_count"] == 1 and most[p + "request_max_num_generation_tokens_sum"] == 5
    assert samples(f[p + "request_params_n"])[p + 'request_params_n_bucket{le="2.0"}'] == 1
    assert samples(f[p + "request_params_max_tokens"])[p + "request_params_max_tokens_sum"] == 50
    assert samples(f[p + "request_params_max_tokens"])[p + 'request_params_max_tokens_bucket{le="100.0"}'] == 1
