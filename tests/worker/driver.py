"""The pure scheduler (with its service's wire conversion) driving an engine in one process: real
page tables, chunked prefill and mixed batches, without Redis."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxstream import protocol
from jaxstream.arrays import from_wire
from scheduler_svc.core import Scheduler
from scheduler_svc.pages import PageAllocator
from scheduler_svc.service import Outbox, SchedulerService


def wire(message, union):
    """The message as the receiving service sees it: encoded and decoded with its stream's union."""
    return protocol.decoder(union).decode(protocol.encode(message))


@dataclass
class Trace:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    logits: list = field(default_factory=list)  # [V] per sampled token, when kept
    top_ids: list = field(default_factory=list)  # [N] per sampled token, when the step returned alternatives
    top_logprobs: list = field(default_factory=list)
    scores: list = field(default_factory=list)  # PromptScores, in step order


class Driver:
    def __init__(self, engine, page_size: int, num_pages: int, budget: int, max_running: int, keep_logits: bool = False):
        core = Scheduler(max_running=max_running, token_budget=budget, page_size=page_size, allocator=PageAllocator(num_pages))
        self.scheduler = SchedulerService(core, page_size)
        self.scheduler.detokenizers = ["detokenizer.one"]
        self.engine = engine
        self.keep_logits = keep_logits
        self.steps: list[protocol.Step] = []

    def run(self, requests: list[tuple[str, list[int], protocol.SamplingParams]]) -> dict[str, Trace]:
        """Submit all requests at once and step until every one has finished."""
        inbox: list = [protocol.TokenizedRequest(rid, "gw", tuple(prompt), s, s.stop_token_ids, s.max_new_tokens)
                       for rid, prompt, s in requests]
        traces = {rid: Trace() for rid, _, _ in requests}
        for _ in range(10_000):
            out = Outbox()
            self.scheduler.take([wire(m, protocol.SchedulerInput | protocol.WorkerOutput) for m in inbox], out)
            assert not out.replies, out.replies
            self.scheduler.plan(out)
            if out.step is None:
                return traces
            step = wire(out.step, protocol.WorkerInput)
            self.steps.append(step)
            result = self.engine.step(step, keep_logits=self.keep_logits)
            result = wire(result, protocol.WorkerOutput)
            tops = None if result.top_ids is None else (from_wire(result.top_ids), from_wire(result.top_logprobs))
            for i, rid in enumerate(result.rids):
                traces[rid].tokens.append(result.token_ids[i])
                traces[rid].logprobs.append(result.logprobs[i])
                if self.keep_logits:
                    traces[rid].logits.append(self.engine.last_logits[i])
                if tops is not None:
                    traces[rid].top_ids.append(tops[0][i])
                    traces[rid].top_logprobs.append(tops[1][i])
            for scores in result.scores:
                traces[scores.rid].scores.append(scores)
            inbox = [result]
        raise AssertionError("requests did not finish")
