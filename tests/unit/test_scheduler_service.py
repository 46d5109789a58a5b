"""The scheduler's service layer without Redis: abort-all and "Abort before prefill", the queue limit,
the request start sent to the detokenizer and the prompt-logprob fields of a published step."""

import msgspec

from jaxstream import protocol
from jaxstream.arrays import from_wire
from scheduler_svc.core import Scheduler
from scheduler_svc.pages import PageAllocator
from scheduler_svc.radix import RadixCache
from scheduler_svc.service import BEFORE_PREFILL, Outbox, SchedulerService


def service(max_running=8, budget=64, page_size=4, num_pages=64, max_queued=None, cache=False, overlap=False) -> SchedulerService:
    pages = PageAllocator(num_pages)
    core = Scheduler(max_running=max_running, token_budget=budget, page_size=page_size, allocator=pages,
                     max_queued=max_queued, cache=RadixCache(page_size, pages) if cache else None)
    svc = SchedulerService(core, overlap=overlap)
    svc.detokenizers = ["detokenizer.one"]
    return svc


def request(rid, prompt=(1, 2, 3), **sampling) -> protocol.TokenizedRequest:
    params = protocol.SamplingParams(**sampling)
    return protocol.TokenizedRequest(rid, "gw", tuple(prompt), params, finish=protocol.FinishRule((2,), 10, params.min_new_tokens))


def step(svc: SchedulerService) -> protocol.Step:
    """Plan and publish a step; answer it as a worker would (token 7 for every sampling seq)."""
    out = Outbox()
    svc.plan(out)
    (planned,) = out.steps
    sampled = [s.rid for s in planned.seqs if s.sample]
    svc.take([protocol.StepResult(planned.step_id, tuple(sampled), (7,) * len(sampled), (-0.5,) * len(sampled))],
             Outbox())
    return planned


def ends(out: Outbox) -> dict[str, protocol.FinishReason]:
    return {e.rid: e.finish for events in out.ended.values() for e in events}


def test_abort_all_ends_every_request_and_marks_those_never_prefilled():
    svc = service(max_running=2, budget=6)
    svc.take([request("decoding"), request("long", range(100, 120)), request("queued")], Outbox())
    step(svc)  # decoding: prompt + first token; long: its first chunk of 3
    out = Outbox()
    svc.take([protocol.AbortRequests((), "paused for a weight update", abort_all=True)], out)
    assert ends(out) == {
        "decoding": protocol.FinishReason("abort", message="paused for a weight update"),
        "long": protocol.FinishReason("abort", message="paused for a weight update"),  # its prompt was fed
        "queued": protocol.FinishReason("abort", message=f"{BEFORE_PREFILL}: paused for a weight update"),
    }
    assert ends(out)["queued"].message.startswith("Abort before prefill")  # AReaL's test
    assert svc.core.rids() == [] and svc.tombstones == {} and svc.core.check_idle() is None
    assert svc.core.stats()["aborted_total"] == 3


def test_abort_of_one_request_before_and_after_prefill():
    svc = service(max_running=1)
    svc.take([request("a"), request("b")], Outbox())
    step(svc)
    out = Outbox()
    svc.take([protocol.AbortRequests(("b", "a", "unknown"), "client disconnected")], out)
    assert ends(out) == {"a": protocol.FinishReason("abort", message="client disconnected"),
                         "b": protocol.FinishReason("abort", message="Abort before prefill: client disconnected")}
    assert list(svc.tombstones) == ["unknown"]  # may still arrive


def test_a_retracted_request_aborted_while_waiting_is_not_before_prefill():
    svc = service(max_running=2, budget=8, page_size=2, num_pages=4)
    svc.take([request("old", (1, 2, 3)), request("new", (4, 5, 6))], Outbox())
    for _ in range(3):  # the third step retracts new to give old a page
        step(svc)
    new = next(r for r in svc.core.waiting if r.rid == "new")
    assert new.computed == 0 and new.output == [7, 7]
    out = Outbox()
    svc.take([protocol.AbortRequests(("new",), "client disconnected")], out)
    assert ends(out)["new"].message == "client disconnected"


def test_queue_limit_rejects_with_503_naming_the_limit():
    svc = service(max_running=1, max_queued=2)
    out = Outbox()
    svc.take([request("a"), request("b"), request("c")], out)
    ((gateway, rejected),) = out.replies
    assert gateway == "gw" and (rejected.rid, rejected.status) == ("c", 503)
    assert "scheduler.max_queued_requests" in rejected.message and "2" in rejected.message
    assert [s.rid for starts in out.started.values() for s in starts] == ["a", "b"]  # c never starts
    step(svc)  # a runs: one waits, so there is room again
    out = Outbox()
    svc.take([request("c")], out)
    assert out.replies == []


def test_request_start_carries_logprob_options():
    svc = service()
    out = Outbox()
    svc.take([request("a", top_logprobs=3, logprob_texts=True, no_stop_trim=True), request("b")], out)
    (a, b) = out.started["detokenizer.one"]
    assert (a.top_logprobs, a.logprob_texts, a.no_stop_trim) == (3, True, True)
    assert (b.top_logprobs, b.logprob_texts, b.no_stop_trim) == (0, False, False)


def test_step_seqs_carry_prompt_len_score_from_and_next_token():
    svc = service(budget=4)
    prompt = list(range(100, 106))
    svc.take([request("a", prompt, prompt_logprobs_from=0), request("b", (9, 8))], Outbox())
    (a,) = step(svc).seqs  # a's first chunk fills the budget
    assert (a.rid, a.num_tokens, a.context_len, a.prompt_len, a.score_from, a.next_token) == ("a", 4, 4, 6, 0, 104)
    second = step(svc)
    b = next(s for s in second.seqs if s.rid == "b")
    assert (b.score_from, b.next_token, b.prompt_len) == (-1, -1, 2)  # no prompt logprobs asked
    a = next(s for s in second.seqs if s.rid == "a")
    tokens = from_wire(second.tokens)[a.start : a.start + a.num_tokens].tolist()
    assert tokens == prompt[4:] and (a.score_from, a.next_token, a.sample) == (5, -1, True)
    third = step(svc)
    a = next(s for s in third.seqs if s.rid == "a")
    assert (a.score_from, a.next_token, a.prompt_len) == (-1, -1, 6)  # a decode


def test_stats_count_requests_tokens_and_aborts():
    svc = service(max_queued=5)
    svc.take([request("a"), request("b", (4, 5))], Outbox())
    step(svc)
    step(svc)
    svc.take([protocol.AbortRequests(("b",))], Outbox())
    st = svc.core.stats()
    assert {k: st[k] for k in ("requests_total", "prompt_tokens_total", "generation_tokens_total", "aborted_total",
                               "running", "waiting", "max_queued_requests")} == {
        "requests_total": 2, "prompt_tokens_total": 5, "generation_tokens_total": 4, "aborted_total": 1,
        "running": 1, "waiting": 0, "max_queued_requests": 5}
    sent = protocol.decoder(protocol.Stats).decode(protocol.encode(protocol.SchedulerStats(**svc.stats())))  # as the heartbeat
    assert isinstance(sent, protocol.SchedulerStats) and (sent.requests_total, sent.max_queued_requests) == (2, 5)


def run_until_idle(svc: SchedulerService) -> list[protocol.Step]:
    steps = []
    while svc.core.rids():
        steps.append(step(svc))
    return steps


def test_a_cache_hit_is_announced_with_the_first_step_and_its_history_sent_for_penalties():
    svc = service(cache=True)
    prompt = tuple(range(100, 110))
    svc.take([request("a", prompt)], Outbox())
    run_until_idle(svc)
    svc.take([request("plain", prompt + (1,)), request("penalized", prompt + (2,), repetition_penalty=1.3)], Outbox())
    out = Outbox()
    svc.plan(out)
    assert [(h.rid, h.cached_tokens) for h in out.events()["detokenizer.one"].cache_hits] == [("plain", 8), ("penalized", 8)]
    plain, penalized = out.steps[0].seqs
    assert plain.context_len - plain.num_tokens == 8 and plain.history is None  # nothing counts earlier tokens
    assert from_wire(penalized.history).tolist() == list(prompt[:8])  # the positions this step does not feed
    assert svc.core.running[1].cached_tokens == 8


def test_flush_cache_answers_the_gateway_refusing_while_requests_live():
    svc = service(cache=True)
    svc.take([request("a", range(9))], Outbox())
    step(svc)
    out = Outbox()
    svc.take([protocol.FlushCache("f1", "gw")], out)
    (gateway, reply), = out.replies
    assert gateway == "gw" and reply.rid == "f1" and not reply.flushed
    assert reply.message == "replica 0: 1 request running and 0 waiting"
    run_until_idle(svc)
    assert svc.core.stats()["pages_cached"] == 4  # 9 prompt + 9 output tokens computed: 4 whole pages
    out = Outbox()
    svc.take([protocol.FlushCache("f2", "gw")], out)
    assert out.replies == [("gw", protocol.FlushCacheReply("f2", True, "replica 0: 4 pages freed"))]
    assert svc.core.stats()["pages_used"] == 0


def test_a_lost_worker_or_a_redis_restart_empties_the_cache():
    svc = service(cache=True)
    svc.take([request("a", range(9))], Outbox())
    run_until_idle(svc)
    assert svc.core.stats()["pages_cached"] == 4
    svc.worker_lost(Outbox())
    assert svc.core.stats()["pages_used"] == 0
    svc.take([request("b", range(9)), request("c", range(50, 59))], Outbox())
    step(svc)
    step(svc)
    svc.reset()  # b and c aborted; what their lost steps computed is not cached
    assert svc.core.stats()["pages_used"] == 0 and svc.core.check_idle() is None


def test_overlap_publishes_the_next_step_before_the_result_and_absorbs_results_in_order():
    svc = service(overlap=True)
    svc.take([request("a", (1, 2, 3), min_new_tokens=2), request("b", (4, 5))], Outbox())
    out = Outbox()
    svc.plan(out)
    first, second = out.steps  # the second planned before the first's result
    assert [(s.rid, s.follows) for s in first.seqs] == [("a", False), ("b", False)]
    a, b = second.seqs
    assert (a.rid, a.follows, a.num_tokens, a.context_len, a.sample) == ("a", True, 1, 4, True)
    assert (a.slot, b.slot) == (first.seqs[0].slot, first.seqs[1].slot) and a.slot != b.slot
    assert from_wire(second.tokens).tolist() == [0, 0]  # the worker reads them from the slots
    # min_new_tokens 2: the first token may not stop, nor the one after it (output index 1)
    assert first.seqs[0].banned == (2,) and a.banned == (2,) and b.banned == ()
    svc.plan(out := Outbox())
    assert out.steps == []  # two in flight: nothing more until a result
    result = protocol.StepResult(first.step_id, ("a", "b"), (7, 2), (-0.5, -0.5))  # b stops on token 2
    svc.take([result], Outbox())
    svc.take([result], Outbox())  # a duplicate: ignored
    assert svc.core.running[0].output == [7] and [r.rid for r in svc.core.running] == ["a"]
    svc.plan(out := Outbox())
    (third,) = out.steps
    assert [(s.rid, s.follows, s.context_len) for s in third.seqs] == [("a", True, 5)]
    svc.take([protocol.StepResult(second.step_id, ("a", "b"), (8, 9), (-0.5, -0.5))], Outbox())  # b's 9 is dropped
    assert svc.core.running[0].output == [7, 8] and svc.core.rids() == ["a"]


def overlapped(svc: SchedulerService) -> tuple[protocol.Step, protocol.Step]:
    """Two steps in flight: a's prompt and its first follower; b's prompt and its follower."""
    svc.take([request("a", (1, 2, 3)), request("b", (4, 5))], Outbox())
    svc.plan(out := Outbox())
    first, second = out.steps
    return first, second


def test_a_result_that_comes_before_an_older_steps_waits_for_it_and_both_are_absorbed_in_step_order():
    # What a consumer whose read's reply was lost once did: the older result came 60 s later, the
    # newer one was dropped as a "duplicate", and the scheduler waited forever for it.
    svc = service(overlap=True)
    first, second = overlapped(svc)
    early = protocol.StepResult(second.step_id, ("a", "b"), (8, 9), (-0.5, -0.5))
    svc.take([early], Outbox())
    assert svc.core.running[0].output == [] and len(svc.in_flight) == 2  # held, not absorbed, not dropped
    svc.take([protocol.StepResult(first.step_id, ("a", "b"), (7, 6), (-0.5, -0.5))], Outbox())
    assert [r.output for r in svc.core.running] == [[7, 8], [6, 9]] and not svc.in_flight and not svc.early
    svc.take([early], Outbox())  # delivered twice: ignored
    assert [r.output for r in svc.core.running] == [[7, 8], [6, 9]]


def test_a_result_lost_for_good_fails_its_steps_requests_and_the_later_results_are_absorbed(monkeypatch):
    svc = service(overlap=True)
    svc.result_wait_s = 5.0
    first, second = overlapped(svc)
    svc.take([request("c", (6, 7))], Outbox())  # waits: it goes in the next step planned
    clock = [100.0]
    monkeypatch.setattr("scheduler_svc.service.time.monotonic", lambda: clock[0])
    svc.take([protocol.StepResult(second.step_id, ("a", "b"), (8, 9), (-0.5, -0.5))], out := Outbox())
    assert ends(out) == {} and len(svc.in_flight) == 2  # within result_wait_s the older result may still come
    clock[0] += 5.0
    svc.take([], out := Outbox())
    lost = protocol.FinishReason("error", message="replica 0 lost a step's result; the request was lost, retry it")
    assert ends(out) == {"a": lost, "b": lost} and not svc.in_flight and not svc.early
    assert svc.core.rids() == ["c"]  # the others go on
    svc.plan(out := Outbox())
    for planned in out.steps:
        assert [seq.rid for seq in planned.seqs] == ["c"]
        svc.take([protocol.StepResult(planned.step_id, ("c",), (7,), (-0.5,))], Outbox())
    assert svc.core.running[0].output == [7, 7]


def test_stats_say_since_when_steps_in_flight_have_had_no_result(monkeypatch):
    svc = service(overlap=True)
    wall = [1000.0]
    monkeypatch.setattr("scheduler_svc.service.time.time", lambda: wall[0])

    def since() -> float | msgspec.UnsetType:
        return protocol.SchedulerStats(**svc.stats()).awaiting_results_since

    assert since() is msgspec.UNSET  # nothing in flight: nothing to wait for
    first, second = overlapped(svc)
    assert since() == 1000.0
    wall[0] = 1030.0  # a wedge: no result for 30 s, and the stats say so however stale they are
    assert since() == 1000.0
    svc.take([protocol.StepResult(first.step_id, ("a", "b"), (7, 6), (-0.5, -0.5))], Outbox())
    assert since() == 1030.0  # progress
    svc.take([protocol.StepResult(second.step_id, ("a", "b"), (8, 9), (-0.5, -0.5))], Outbox())
    assert since() is msgspec.UNSET  # nothing in flight again


def test_a_restarted_schedulers_steps_come_after_its_predecessors():
    """A result the dead scheduler's worker left on the results stream must not pass for a new step."""
    old = service()
    old.take([request("a")], Outbox())
    last = [step(old).step_id for _ in range(3)][-1]
    new = service()
    new.take([request("a")], out := Outbox())  # a client retrying the same rid
    assert out.started["detokenizer.one"][0].first_step > last
    assert step(new).step_id > last


def test_a_lost_worker_takes_its_steps_in_flight_and_the_requests_that_ran_on_it():
    svc = service(overlap=True, max_running=1)
    svc.take([request("ran", (1, 2, 3)), request("queued", (4, 5))], Outbox())
    svc.plan(out := Outbox())
    assert len(out.steps) == 2 and len(svc.in_flight) == 2
    svc.worker_lost(out := Outbox())
    assert list(ends(out)) == ["ran"] and "worker stopped" in ends(out)["ran"].message
    assert ends(out)["ran"].type == "error"  # a server failure: the gateway answers a 503, not finish_reason abort
    assert not svc.in_flight and svc.core.rids() == ["queued"]  # waits for the next worker
    svc.plan(out := Outbox())  # with no step in flight, planning goes on
    assert [[s.rid for s in planned.seqs] for planned in out.steps] == [["queued"], ["queued"]]


def test_a_page_leak_at_idle_is_logged_once_while_it_lasts(caplog):
    svc = service()
    svc.idle_check()
    svc.core.allocator.allocate(2)  # two pages nobody holds: a leak
    for _ in range(3):  # the idle loop turns once a redis.block_ms
        svc.idle_check()
    assert [r.getMessage() for r in caplog.records] == ["page leak at idle: idle, yet 2 of 64 KV pages are allocated outside the prefix cache"]
