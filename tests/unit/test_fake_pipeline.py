"""Scheduler service, fake worker and detokenizer wired in one process through the wire format:
the step/result/event logic of the pipeline without Redis or processes."""

import asyncio
import random
import re

import msgspec

from detokenizer_svc.service import Detokenizer
from jaxstream import protocol
from scheduler_svc.core import Scheduler
from scheduler_svc.pages import PageAllocator
from scheduler_svc.radix import RadixCache
from scheduler_svc.service import Outbox, SchedulerService
from tests.worker.driver import wire
from worker_svc.control import DeviceControl, Source
from worker_svc.fake import FakeEngine


class Pipeline:
    def __init__(self, tokenizer, num_pages=64, page_size=4, budget=32, max_running=8, vocab=49152, cache=False, overlap=True):
        pages = PageAllocator(num_pages)
        core = Scheduler(max_running=max_running, token_budget=budget, page_size=page_size, allocator=pages,
                         cache=RadixCache(page_size, pages) if cache else None)
        self.scheduler = SchedulerService(core, overlap=overlap)
        self.scheduler.detokenizers = ["detokenizer.one"]
        self.worker = FakeEngine(num_pages, page_size, vocab)
        self.blobs: dict[str, bytes] = {}  # the Redis keys a tensor update's bytes wait in
        self.device = DeviceControl(self.worker, self, 0, Source(None))
        self.detok = Detokenizer(tokenizer)
        self.outputs: dict[str, list[protocol.RequestOutput]] = {}
        self.replies: list[protocol.ControlReply] = []  # to the gateway
        self.rejected: list[protocol.RequestRejected] = []  # to the gateway
        self.inbox: list = []
        self.planned: list = []  # published, not run yet: the worker runs the oldest (a Step or a control message)
        self.steps = 0

    async def get_blob(self, keys):  # the worker's Bus, for DeviceControl
        return b"".join(self.blobs[k] for k in keys)

    def ask(self, message):
        """A control message from the gateway, taken with the next turn."""
        self.inbox.append(message)

    def submit(self, rid, prompt, max_new, stop=(), stop_ids=(), **sampling_fields):
        sampling = protocol.SamplingParams(max_new_tokens=max_new, stop=stop, **sampling_fields)
        self.inbox.append(protocol.TokenizedRequest(rid, "gw", tuple(prompt), sampling, finish=protocol.FinishRule(tuple(stop_ids), max_new)))

    def run(self, max_steps=1000, settle=True):
        for _ in range(max_steps):
            out = Outbox()
            self.scheduler.take([wire(m, protocol.SchedulerInput | protocol.WorkerOutput) for m in self.inbox], out)
            self.inbox = []
            self.scheduler.plan(out)  # with overlap: the step after the one the worker runs next, too
            detok_in = [wire(events, protocol.DetokenizerInput) for events in out.events().values()]
            self.planned += [wire(message, protocol.WorkerInput) for message in [*out.steps, *out.to_worker]]
            self.replies += [reply for _, reply in out.replies if isinstance(reply, protocol.ControlReply)]
            self.rejected += [reply for _, reply in out.replies if isinstance(reply, protocol.RequestRejected)]
            if self.planned:
                message = self.planned.pop(0)
                if isinstance(message, protocol.Step):
                    self.steps += 1
                    result = msgspec.structs.replace(self.worker.step(message), weight_version=self.device.version)
                else:
                    result = asyncio.run(self.device.handle(message))
                self.inbox.append(result)
                detok_in.append(wire(result, protocol.WorkerOutput))
            by_gateway, stopped = self.detok.step(detok_in)
            for output in by_gateway.get("gw", []):
                self.outputs.setdefault(output.rid, []).append(output)
            assert set(stopped) <= {0}  # one replica
            if stopped:
                self.inbox.append(protocol.StopRequests(tuple(stopped[0])))
            if not out.steps and not out.to_worker and not self.inbox and not self.planned:
                return
        assert not settle, "pipeline did not settle"

    def tokens(self, rid):
        return [t for o in self.outputs[rid] for t in o.token_ids]

    def text(self, rid):
        return "".join(o.text for o in self.outputs[rid])

    def finish(self, rid):
        finishes = [o.finish for o in self.outputs[rid] if o.finish is not None]
        assert len(finishes) == 1, finishes  # exactly one final output
        return finishes[0]


def test_requests_of_mixed_lengths_get_the_fake_arithmetic(tokenizer_info):
    p = Pipeline(tokenizer_info.tokenizer)
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 70))] for i in range(12)}
    for rid, prompt in prompts.items():
        p.submit(rid, prompt, max_new=9)
    p.run()
    for rid, prompt in prompts.items():
        expected = [prompt[-1] + i for i in range(1, 10)]
        assert p.tokens(rid) == expected
        assert p.text(rid) == tokenizer_info.tokenizer.decode(expected, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert p.finish(rid) == protocol.FinishReason("length", length=9)
    assert p.scheduler.core.check_idle() is None and p.scheduler.core.stats()["pages_used"] == 0


def test_a_tiny_page_pool_preempts_and_gives_the_same_tokens(tokenizer_info):
    p = Pipeline(tokenizer_info.tokenizer, num_pages=12, page_size=4, budget=16)
    for i in range(6):
        p.submit(f"r{i}", [1000 * (i + 1), 7, 1000 * (i + 1) + 5], max_new=12)
    p.run()
    for i in range(6):
        assert p.tokens(f"r{i}") == [1000 * (i + 1) + 5 + k for k in range(1, 13)]
    assert p.scheduler.core.check_idle() is None


def test_stop_string_and_abort(tokenizer_info):
    tok = tokenizer_info.tokenizer
    p = Pipeline(tok)
    cont = [5001 + k for k in range(30)]
    stop = tok.decode([cont[4]]).strip()
    p.submit("s", [5000], max_new=30, stop=(stop,))
    p.submit("a", [6000], max_new=500)
    p.scheduler.take([protocol.AbortRequests(("early",))], Outbox())  # abort before its request arrives
    p.submit("early", [7000], max_new=5)
    p.run(max_steps=3, settle=False)  # a few steps in, then the client of "a" leaves
    p.inbox.append(protocol.AbortRequests(("a",), "client disconnected"))
    p.run()
    full = tok.decode(cont, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert p.text("s") == full[: full.index(stop)] and p.finish("s") == protocol.FinishReason("stop", matched=stop)
    assert p.finish("a").type == "abort" and 0 < len(p.tokens("a")) < 500
    assert "early" not in p.outputs  # dropped by its tombstone, never ran
    assert p.scheduler.core.check_idle() is None


def test_prompt_ids_come_back_with_the_first_output_when_asked(tokenizer_info):
    p = Pipeline(tokenizer_info.tokenizer, budget=8)  # the 20-token prompt is fed in 3 chunks
    prompt = list(range(300, 320))
    p.submit("asked", prompt, max_new=4, return_prompt_token_ids=True)
    p.submit("not", prompt, max_new=4)
    p.run()
    assert [o.prompt_token_ids for o in p.outputs["asked"]] == [tuple(prompt), (), (), ()]
    assert all(o.prompt_token_ids == () for o in p.outputs["not"])


def test_stop_regex_ends_the_request_and_the_scheduler_stops_it(tokenizer_info):
    tok = tokenizer_info.tokenizer
    p = Pipeline(tok)
    cont = [5001 + k for k in range(40)]
    piece = tok.decode([cont[6]]).strip()
    p.submit("r", [5000], max_new=40, stop_regex=("(?:" + re.escape(piece) + ")",))
    p.run()
    full = tok.decode(cont, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert p.text("r") == full[: full.index(piece) + len(piece)]
    assert p.finish("r") == protocol.FinishReason("stop", matched="(?:" + re.escape(piece) + ")")
    assert len(p.tokens("r")) == 7 and p.scheduler.core.check_idle() is None


def test_requests_are_spread_over_detokenizers_and_a_dead_ones_are_failed():
    core = Scheduler(max_running=8, token_budget=64, page_size=4, allocator=PageAllocator(32))
    service = SchedulerService(core)
    service.set_detokenizers(["detokenizer.a", "detokenizer.b"], Outbox())

    def request(rid):
        return protocol.TokenizedRequest(rid, "gw", (1, 2, 3), protocol.SamplingParams(), finish=protocol.FinishRule((2,), 10))

    out = Outbox()
    service.take([request(f"r{i}") for i in range(4)], out)
    assert {d: [s.rid for s in starts] for d, starts in out.started.items()} == {
        "detokenizer.a": ["r0", "r2"], "detokenizer.b": ["r1", "r3"]}
    assert set(out.events()) == {"detokenizer.a", "detokenizer.b"}  # one events message per instance

    out = Outbox()
    service.set_detokenizers(["detokenizer.a"], out)  # b died
    assert sorted(m.rid for _, m in out.replies) == ["r1", "r3"] and {m.status for _, m in out.replies} == {503}
    assert sorted(core.rids()) == ["r0", "r2"]

    out = Outbox()
    service.set_detokenizers([], out)
    service.take([request("late")], out)
    assert [(m.rid, m.status) for _, m in out.replies if m.rid == "late"] == [("late", 503)]
    assert core.rids() == [] and core.check_idle() is None


def test_cached_tokens_reach_the_outputs_and_the_tokens_are_the_same(tokenizer_info):
    p = Pipeline(tokenizer_info.tokenizer, num_pages=24, page_size=4, budget=16, cache=True)
    shared = list(range(2000, 2030))  # 30 tokens: 7 whole pages
    p.submit("first", shared + [1], max_new=5)
    p.run()
    for i in range(4):
        p.submit(f"r{i}", shared + [100 * (i + 1)], max_new=5)
    p.run()
    assert [o.cached_tokens for o in p.outputs["first"]] == [0] * len(p.outputs["first"])
    for i in range(4):
        assert p.tokens(f"r{i}") == [100 * (i + 1) + k for k in range(1, 6)]
        assert {o.cached_tokens for o in p.outputs[f"r{i}"]} == {28}, i  # in every output, the first included
    st = p.scheduler.core.stats()
    assert p.scheduler.core.check_idle() is None and st["pages_used"] == st["pages_cached"] > 0
    assert st["prefix_cache_hits_total"] == 4 * 28 and st["preempted_total"] == 0


def test_prefill_only_requests_score_their_prompt_and_sample_nothing(tokenizer_info):
    # max_new_tokens 0 (SGLang's way to score a prompt): chunked (budget 16), reading the prefix
    # cache up to the first position to score, beside a request that samples; each ends with one
    # output: every asked prompt logprob, no token, finish length 0.
    p = Pipeline(tokenizer_info.tokenizer, num_pages=32, page_size=4, budget=16, cache=True)
    prompt = list(range(3000, 3040))  # 40 tokens: 3 chunks, 10 whole pages
    p.submit("warm", prompt, max_new=2)
    p.run()
    asked = {"from0": 0, "from30": 30, "none": -1}
    for rid, first in asked.items():
        sampling = protocol.SamplingParams(max_new_tokens=0, prompt_logprobs_from=first)
        p.inbox.append(protocol.TokenizedRequest(rid, "gw", tuple(prompt), sampling, finish=protocol.FinishRule((), 0)))
    p.submit("beside", [5000], max_new=6)
    p.run()
    assert p.tokens("beside") == [5001 + k for k in range(6)]
    for rid, first in asked.items():
        (only,) = p.outputs[rid]
        assert only.finish == protocol.FinishReason("length", length=0) and only.token_ids == () and only.text == ""
        assert only.completion_tokens == 0 and only.prompt_tokens == 40
        scored = [q for q in range(len(prompt)) if 0 <= first <= q]
        assert [t.token_id for t in only.prompt_logprobs] == [prompt[q] for q in scored]
        assert [t.logprob for t in only.prompt_logprobs if t.token_id != prompt[0]] == [-(prompt[q] % 10) / 10 for q in scored if q]
    # up to the first position to score, less one (its predictor is fed), page-aligned; all but the last token unscored
    assert [p.outputs[rid][0].cached_tokens for rid in asked] == [0, 28, 36]
    st = p.scheduler.core.stats()
    assert st["generation_tokens_total"] == 2 + 6 and p.scheduler.core.check_idle() is None
    assert st["pages_used"] == st["pages_cached"]
