"""The scheduler's loop in one process, with an engine in place of the worker stream: the real
scheduler core (with its service's wire conversion) driving a worker engine, without Redis.

Each turn is the scheduler service's: take what arrived (submitted requests, the last step's
result), plan, and run the oldest planned step on the engine. With overlap, the scheduler plans one
step ahead of the results it took, as it does serving: decodes follow the tokens in flight, which the
engine reads from its slots. Messages are encoded and decoded with their stream's
union on the way, as the receiving service would see them. Used by the worker and model tests
(`run`) and by `jaxstream bench --in-process` (`submit` / `take` / `step`, one turn at a time).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from jaxstream import protocol
from jaxstream.arrays import from_wire
from jaxstream.config import SchedulerConfig
from jaxstream.stopping import finish_reason
from scheduler_svc.core import Scheduler
from scheduler_svc.ngram import NgramDrafter
from scheduler_svc.pages import PageAllocator
from scheduler_svc.radix import prefix_cache as prefix_cache_for
from scheduler_svc.adapters import AdapterRegistry
from scheduler_svc.service import Outbox, SchedulerService
from worker_svc.engine_api import StepEngine

INBOX = protocol.SchedulerInput | protocol.WorkerOutput  # what the scheduler reads


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
    ids_logprobs: list = field(default_factory=list)  # [I] per sampled token, when the step returned token_ids_logprob's
    scores: list = field(default_factory=list)  # PromptScores, in step order
    experts: list = field(default_factory=list)  # RoutedExperts, in step order, when the request asked

    def finished(self, rule: protocol.FinishRule) -> bool:
        """Its last token ended it by the finish rule."""
        return bool(self.tokens) and finish_reason(self.tokens[-1], len(self.tokens), rule) is not None


class Driver:
    def __init__(self, engine: StepEngine, page_size: int, num_pages: int, budget: int, max_running: int, keep_logits: bool = False,
                 max_queued: int | None = None, keep_steps: bool = True, prefix_cache: bool = False, policy: str = "fcfs",
                 overlap: bool = False, drafter: NgramDrafter | None = None, adapters: AdapterRegistry | None = None,
                 state_slots: bool = False):
        """`keep_logits`: each token's raw logits in its Trace, which only the JAX engine keeps
        (`Engine.step(keep_logits=True)`, its `last_logits`: the parity tests'). `adapters`: which
        LoRA adapter is in which of the engine's slots (a request names one by SamplingParams.lora).
        `state_slots`: the model is a hybrid, its slots a state pool (the core's stats report them)."""
        pages = PageAllocator(num_pages)
        # a hybrid engine's state snapshots (engine.py), as the scheduler service learns of them from the model
        cache = prefix_cache_for(page_size, pages, prefix_cache, getattr(engine, "state_snapshots", None))
        core = Scheduler(max_running=max_running, token_budget=budget, page_size=page_size, allocator=pages,
                         max_queued=max_queued, cache=cache, policy=policy, drafter=drafter, state_slots=state_slots)
        self.scheduler = SchedulerService(core, overlap=overlap, adapters=adapters)
        self.scheduler.detokenizers = ["detokenizer.one"]
        self.engine = engine
        self.keep_logits = keep_logits
        self.keep_steps = keep_steps
        self.steps: list[protocol.Step] = []  # every step run, when keep_steps
        self.planned: deque[protocol.Step] = deque()  # published, not run yet (with overlap, at most one after a turn)
        self.inbox: list = []  # for the scheduler's next take: submitted requests, the last result
        self.rejected: list[protocol.RequestRejected] = []  # the scheduler's refusals, in order

    @classmethod
    def for_config(cls, engine: StepEngine, s: SchedulerConfig, **kwargs) -> Driver:
        """The core the scheduler service builds from this config (scheduler_svc/__main__.py)."""
        return cls(engine, s.page_size, s.num_pages, s.max_tokens_per_step, s.max_running_requests,
                   max_queued=s.max_queued_requests, prefix_cache=s.prefix_cache, policy=s.policy, overlap=s.overlap,
                   drafter=NgramDrafter.configured(s), **kwargs)

    def submit(self, request: protocol.TokenizedRequest) -> None:
        self.inbox.append(request)

    def take(self) -> list[protocol.RequestRejected]:
        """The scheduler takes what arrived; a finished request leaves it here. Returns its refusals."""
        out = Outbox()
        self.scheduler.take([wire(m, INBOX) for m in self.inbox], out)
        self.inbox = []
        rejected = [reply for _, reply in out.replies]
        self.rejected += rejected
        return rejected

    def step(self) -> protocol.StepResult | None:
        """One turn: take, plan as far ahead as the scheduler does, run the oldest planned step (its
        result is taken next turn). None: nothing to run. With overlap, a result may name a request
        that ended on the token before (not held any more): its token is not the request's."""
        self.take()
        out = Outbox()
        self.scheduler.plan(out)
        self.planned += [wire(step, protocol.WorkerInput) for step in out.steps]
        if not self.planned:
            return None
        step = self.planned.popleft()
        if self.keep_steps:
            self.steps.append(step)
        result = self.engine.step(step, keep_logits=True) if self.keep_logits else self.engine.step(step)
        result = wire(result, protocol.WorkerOutput)
        self.inbox.append(result)
        return result

    def held(self) -> set[str]:
        """The requests the scheduler holds (running or waiting): not finished yet."""
        return set(self.scheduler.core.rids())

    def run(self, requests: list[tuple[str, list[int], protocol.SamplingParams]]) -> dict[str, Trace]:
        """Submit all requests at once and step until every one has finished."""
        for rid, prompt, s in requests:
            rule = protocol.FinishRule(s.stop_token_ids, s.max_new_tokens, s.min_new_tokens)
            self.submit(protocol.TokenizedRequest(rid, "gw", tuple(prompt), s, finish=rule))
        traces = {rid: Trace() for rid, _, _ in requests}
        rules = {rid: protocol.FinishRule(s.stop_token_ids, s.max_new_tokens, s.min_new_tokens) for rid, _, s in requests}
        for _ in range(10_000):
            result = self.step()
            assert not self.rejected, self.rejected
            if result is None:
                return traces
            tops = None if result.top_ids is None else (from_wire(result.top_ids), from_wire(result.top_logprobs))
            of_ids = None if result.ids_logprobs is None else from_wire(result.ids_logprobs)
            held = self.held()  # the results taken so far ended some
            for i, rid in enumerate(result.rids):
                # a verified draft's tokens after the one that finishes it are not the request's
                if rid not in held or traces[rid].finished(rules[rid]):
                    continue
                traces[rid].tokens.append(result.token_ids[i])
                traces[rid].logprobs.append(result.logprobs[i])
                if self.keep_logits:
                    traces[rid].logits.append(self.engine.last_logits[i])
                if tops is not None:
                    traces[rid].top_ids.append(tops[0][i])
                    traces[rid].top_logprobs.append(tops[1][i])
                if of_ids is not None:
                    traces[rid].ids_logprobs.append(of_ids[i])
            for scores in result.scores:
                traces[scores.rid].scores.append(scores)
            for experts in result.experts:
                if experts.rid in held:
                    traces[experts.rid].experts.append(experts)
        raise AssertionError("requests did not finish")
