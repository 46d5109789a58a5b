"""The scheduler's service loop around the pure core: messages in, steps and events out.

It holds what the core must not: the clock (abort tombstones expire), the wire format of a step,
and the bookkeeping of the steps in flight: with overlap, two (step N + 1 is planned and published
as soon as step N is, so the worker finds it waiting when N ends; decodes whose token N samples
follow it, core.py), else one.

Step results are absorbed in step order, checked by step id. A result of no step in flight was
absorbed already (delivered twice) or is of a step this scheduler forgot (its worker died, or a
predecessor's): ignored. A result of a later step in flight than the oldest waits until the
oldest's comes (the consumer reads what Redis handed it again before anything new, so a result
whose reply was lost comes next). If the oldest's has not come within `result_wait_s` while a
later one did, it is lost: its requests end with an error (their clients get a 503 or an SSE error
event) and the later results are absorbed for the others. None is dropped as a duplicate while its
step is in flight, which once left a scheduler waiting forever for a result it had thrown away.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import msgspec
import numpy as np

from jaxstream import protocol
from jaxstream.arrays import to_wire
from jaxstream.english import counted
from jaxstream.names import replica_of, role_of
from jaxstream.protocol import FinishReason
from jaxstream.stopping import prefill_only
from jaxstream.transport import TRANSIENT, Bus
from scheduler_svc.adapters import AdapterRegistry, UnknownAdapter
from scheduler_svc.control import Control, ToWorker
from scheduler_svc.core import Busy, QueueFull, Request, Scheduler, StepPlan, Unschedulable
from scheduler_svc.placements import Placements

log = logging.getLogger(__name__)

TOMBSTONE_TTL_S = 60.0
# The message prefix of an abort that came before any of the request's tokens was fed to the model:
# SGLang's words, on which RL clients (AReaL) rely to resubmit the request as if it never ran.
BEFORE_PREFILL = "Abort before prefill"


class Outbox:
    """What one loop iteration publishes, in order: request events first (a request's start must
    reach the detokenizer before its first result can), then the steps, oldest first."""

    def __init__(self) -> None:
        self.started: dict[str, list[protocol.RequestStart]] = {}  # by detokenizer instance
        self.ended: dict[str, list[protocol.RequestEnd]] = {}
        self.hits: dict[str, list[protocol.CacheHit]] = {}
        self.replies: list[tuple[str, protocol.GatewayInput]] = []  # (gateway, message)
        self.write_stats = False  # a gateway asked for them (WriteStats): written before the replies
        self.steps: list[protocol.Step] = []
        self.to_worker: list[ToWorker] = []  # after the steps (control.py)
        self.adapter_names: dict[str, str] = {}  # to write into the names every gateway reads (control.py, 5.)
        self.adapters_gone: list[str] = []  # to delete from them

    def end(self, request: Request, finish: FinishReason) -> None:
        self.ended.setdefault(request.detokenizer, []).append(protocol.RequestEnd(request.rid, request.gateway, finish))

    def hit(self, request: Request) -> None:
        self.hits.setdefault(request.detokenizer, []).append(protocol.CacheHit(request.rid, request.cached_tokens))

    def events(self) -> dict[str, protocol.RequestEvents]:
        return {d: protocol.RequestEvents(tuple(self.started.get(d, ())), tuple(self.ended.get(d, ())), tuple(self.hits.get(d, ())))
                for d in self.started.keys() | self.ended.keys() | self.hits.keys()}


class SchedulerService:
    def __init__(self, core: Scheduler, replica: int = 0, overlap: bool = True, keep_placements_s: float = 15.0,
                 result_wait_s: float = 10.0, adapters: AdapterRegistry | None = None) -> None:
        self.core = core
        self.replica = replica  # the data-parallel replica this scheduler is
        self.depth = 2 if overlap else 1  # steps in flight at most
        self.in_flight: deque[tuple[int, StepPlan]] = deque()  # (step id, plan), oldest first
        self.early: dict[int, protocol.StepResult] = {}  # results of later steps in flight than the oldest, by step id
        self.early_since = 0.0  # when the first of `early` came (monotonic)
        self.result_wait_s = result_wait_s  # how long the oldest step's result may lag a later one's
        # Liveness (SchedulerStats.awaiting_results_since): the wall-clock time of the last result
        # absorbed, or of the step sent while none was in flight.
        self.progress_at = time.time()
        # Ids go on from the clock (microseconds), not from 0: a restarted scheduler's steps come
        # after its predecessor's, so a result the dead one's worker left on the results stream
        # can neither pass for one of the new steps nor give its token to a request that reused
        # its rid since (the detokenizer keeps a request's results from its first step on).
        self.step_id = time.time_ns() // 1000
        self.tombstones: dict[str, float] = {}  # rid -> when an abort arrived before its request
        self.detokenizers: list[str] = []  # live instances; requests are spread over them in turn
        self.admitted = 0
        self.control = Control(core, replica, adapters)
        self.placements = Placements(keep_placements_s)
        self.leak_logged: str | None = None  # the page leak last logged, while it lasts

    def take(self, messages: list[object], out: Outbox) -> None:
        for message in messages:
            match message:
                case protocol.TokenizedRequest():
                    self.admit(message, out)
                case protocol.AbortRequests(abort_all=True, message=reason):
                    self.abort_all(reason, out)
                case protocol.AbortRequests(rids=rids, message=reason):
                    for rid in rids:
                        self.abort(rid, reason, out)
                case protocol.StopRequests(rids=rids):
                    for rid in rids:
                        self.core.finish(rid, time.monotonic())  # the detokenizer already told the client
                case protocol.FlushCache(rid=rid, gateway=gateway):
                    out.replies.append((gateway, self.flush_cache(rid)))
                case protocol.WriteStats(rid=rid, gateway=gateway):
                    out.write_stats = True
                    out.replies.append((gateway, protocol.ControlReply(rid, True, replica=self.replica)))
                case protocol.StepResult():
                    self.absorb(message, out)
                case protocol.PauseGeneration():
                    self.control.pause(message, lambda reason: self.abort_all(reason, out), out)
                case protocol.ContinueGeneration():
                    self.control.resume(message, out)
                case protocol.UpdateWeights():
                    self.control.update(message, out)
                case protocol.Memory():
                    self.control.memory(message, out)
                case protocol.WeightGroup():
                    self.control.group(message, out)
                case protocol.LoadAdapter():
                    self.control.load_adapter(message, out)
                case protocol.UnloadAdapter():
                    self.control.unload_adapter(message, out)
                case protocol.ControlReply():
                    self.control.answered(message, out)
        self.give_up_lost_results(out)
        self.control.tick(len(self.in_flight), out)

    def abort_all(self, reason: str, out: Outbox) -> int:
        rids = self.core.rids()
        for rid in rids:
            self.abort(rid, reason, out)
        return len(rids)

    def admit(self, msg: protocol.TokenizedRequest, out: Outbox) -> None:
        if self.tombstones.pop(msg.rid, None) is not None:
            return  # its client left while it was being tokenized
        if not self.detokenizers:
            out.replies.append((msg.gateway, protocol.RequestRejected(msg.rid, 503, "no detokenizer is running")))
            return
        if (refusal := self.control.refusal()) is not None:
            out.replies.append((msg.gateway, protocol.RequestRejected(msg.rid, 503, refusal)))
            return
        try:  # the gateway checked the name; it may have been unloaded since (another gateway's unload)
            adapter, namespace = self.control.adapters.resolve(msg.sampling.lora)
        except UnknownAdapter as exc:
            out.replies.append((msg.gateway, protocol.RequestRejected(msg.rid, 404, str(exc), "model", "model_not_found")))
            return
        request = Request(
            detokenizer=self.detokenizers[self.admitted % len(self.detokenizers)],
            rid=msg.rid,
            gateway=msg.gateway,
            prompt=list(msg.input_ids),
            sampling=msg.sampling,
            finish=msg.finish,
            arrived=time.monotonic(),
            adapter=adapter,
            namespace=namespace,
        )
        try:
            self.core.add(request)
        except QueueFull as exc:  # the gateway answers 503 with Retry-After
            out.replies.append((msg.gateway, protocol.RequestRejected(msg.rid, 503, str(exc))))
            return
        except Unschedulable as exc:
            out.replies.append((msg.gateway, protocol.RequestRejected(msg.rid, 400, str(exc), "prompt")))
            return
        except ValueError as exc:  # a rid already running (clients may choose rids)
            out.replies.append((msg.gateway, protocol.RequestRejected(msg.rid, 400, str(exc), "rid")))
            return
        self.admitted += 1
        self.placements.place(msg.rid, msg.gateway, request.detokenizer)
        s = msg.sampling
        out.started.setdefault(request.detokenizer, []).append(protocol.RequestStart(
            msg.rid, msg.gateway, len(msg.input_ids), s.stop, skip_special_tokens=s.skip_special_tokens,
            top_logprobs=s.top_logprobs, logprob_texts=s.logprob_texts, no_stop_trim=s.no_stop_trim,
            replica=self.replica, first_step=self.step_id + 1, finish=request.finish,
            routed_experts_from=s.routed_experts_start_len if s.return_routed_experts else -1,
            token_ids_logprob=s.token_ids_logprob,
            stop_regex=s.stop_regex, prompt_ids=msg.input_ids if s.return_prompt_token_ids else (),
            prompt_top_logprobs=s.prompt_alternatives(), channels=s.channels,
        ))

    def flush_cache(self, rid: str) -> protocol.FlushCacheReply:
        """Empty the prefix cache, or say why not; never aborts a request. A step in flight is no
        obstacle: the worker runs it before any step that reuses the pages freed."""
        try:
            pages = self.core.flush_cache(waiting_too=self.control.paused is None)  # paused: waiting ones hold no page
        except Busy as exc:
            return protocol.FlushCacheReply(rid, False, f"replica {self.replica}: {exc}")
        log.info("prefix cache flushed: %d pages freed", pages)
        return protocol.FlushCacheReply(rid, True, f"replica {self.replica}: {counted(pages, 'page')} freed")

    def worker_lost(self, out: Outbox) -> None:
        """The replica's worker stopped: the KV the cache names is gone with it, and so are the steps
        it had not answered (acked once read; a new worker could not run them on an empty cache).
        The requests that ran on it end with an `error` finish, which their gateway turns into a 503
        (an SSE error event once streaming): a server failure, not an abort, whichever of this and
        the gateway's own watchdog tells the client first. Waiting ones wait for the next worker."""
        lost = [r for r in self.core.running + self.core.waiting if r.computed or r.awaiting]
        log.warning("the worker stopped: %d steps in flight, %d requests and the prefix cache lost", len(self.in_flight), len(lost))
        self.in_flight.clear()
        self.early.clear()
        self.core.invalidate_cache()
        for request in lost:
            self.core.abort(request.rid)
            out.end(request, FinishReason("error", message=f"replica {self.replica}'s worker stopped; the request was lost, retry it"))
        self.control.worker_lost(out)  # after: it fails the waiting ones whose adapter slot went

    def abort(self, rid: str, reason: str, out: Outbox) -> None:
        request = self.core.abort(rid)
        if request is None:
            self.tombstones[rid] = time.monotonic()
            return
        message = reason if request.prefilled else f"{BEFORE_PREFILL}: {reason}"
        out.end(request, FinishReason("abort", message=message))

    def absorb(self, result: protocol.StepResult, out: Outbox) -> None:
        """Take a step's result in step order (this module's docstring)."""
        steps = [step_id for step_id, _ in self.in_flight]
        if result.step_id not in steps:
            log.warning("result of step %d ignored: no such step in flight (%s)", result.step_id, steps or "none")
        elif result.step_id != steps[0]:
            if not self.early:
                self.early_since = time.monotonic()
                log.warning("result of step %d came before step %d's: held until that one comes", result.step_id, steps[0])
            self.early[result.step_id] = result
        else:
            self._absorb_oldest(result, out)
            while self.in_flight and (held := self.early.pop(self.in_flight[0][0], None)) is not None:
                self._absorb_oldest(held, out)

    def give_up_lost_results(self, out: Outbox) -> None:
        """The oldest step's result lagging a later one's for `result_wait_s` is lost: end that
        step's requests with an error, then absorb the results that waited behind it."""
        if not self.early or time.monotonic() - self.early_since < self.result_wait_s:
            return
        while self.early and self.in_flight:
            step_id, plan = self.in_flight.popleft()
            if (held := self.early.pop(step_id, None)) is not None:
                self._absorb_oldest(held, out, popped=plan)
                continue
            lost = {planned.request.rid: planned.request for planned in plan.seqs}
            log.error("the result of step %d never came: failing its %d requests", step_id, len(lost))
            for request in lost.values():
                if self.core.abort(request.rid) is not None:
                    out.end(request, FinishReason("error", message=f"replica {self.replica} lost a step's result; "
                                                                   "the request was lost, retry it"))
        self.early.clear()

    def _absorb_oldest(self, result: protocol.StepResult, out: Outbox, popped: StepPlan | None = None) -> None:
        plan = self.in_flight.popleft()[1] if popped is None else popped
        self.progress_at = time.time()
        sampled: dict[str, list[tuple[int, float]]] = {}  # a draft's verified tokens are rows of one rid
        for rid, tok, lp in zip(result.rids, result.token_ids, result.logprobs):
            sampled.setdefault(rid, []).append((tok, lp))
        # Finished requests need no message: the detokenizer applies the same finish rule to the same
        # result (and drops the token a step that followed sampled after the finish). A request that
        # samples nothing (core.py 7.) it ends on its last prompt position's score; one that scores
        # nothing leaves no trace in any result: only this end tells it. It follows the request's
        # start and cache hit on the same stream, so the detokenizer has all it will ever get.
        for done in self.core.absorb(plan, sampled, time.monotonic()):
            if prefill_only(done.request.finish) is not None and not done.request.scores_prompt:
                out.end(done.request, done.finish)

    def plan(self, out: Outbox) -> None:
        """Plan steps until `depth` are in flight or there is nothing to run: with overlap, a step
        and the one after it (whose decodes follow the first's tokens) go out together."""
        now = time.monotonic()
        self.tombstones = {rid: t for rid, t in self.tombstones.items() if now - t < TOMBSTONE_TTL_S}
        while len(self.in_flight) < self.depth and self.control.may_step:
            plan = self.core.plan(admit=self.control.may_admit, now=now)
            if plan is None:
                return
            for ended in plan.ended:  # outgrew the whole page pool: a finish the detokenizer cannot see
                out.end(ended.request, ended.finish)
            if not plan.seqs:
                return
            for planned in plan.seqs:
                if planned.first and planned.start:  # its first step: with the events, before its first result
                    out.hit(planned.request)
            self.step_id += 1
            if not self.in_flight:
                self.progress_at = time.time()  # waiting for results from now on
            self.in_flight.append((self.step_id, plan))
            out.steps.append(self.to_step(plan))

    def to_step(self, plan: StepPlan) -> protocol.Step:
        seqs, tokens, positions = [], [], []
        for planned in plan.seqs:
            n = len(planned.tokens)
            req = planned.request
            # As vLLM's min_tokens: no stop token is sampled until the request has min_new_tokens
            # tokens (the tokenizer bounds how many stop tokens there are). A seq that follows
            # samples the token after the one in flight.
            early = planned.sample and len(req.output) + planned.follows < req.finish.min_new_tokens
            # The positions the cache gave it, which penalties count and a constraint's matcher
            # consumed, but this step does not feed.
            history = None
            if planned.from_cache and req.sampling.reads_output():
                history = to_wire(np.asarray(req.known(0, planned.start), dtype=np.int32))
            seqs.append(protocol.StepSeq(req.rid, len(tokens), n, planned.start + n, planned.sample,
                                         req.sampling if planned.takes_slot else None,
                                         req.finish.stop_token_ids if early else (), prompt_len=len(req.prompt),
                                         score_from=planned.score_from, next_token=planned.next_token, history=history,
                                         slot=req.slot, follows=planned.follows, drafts=planned.drafts,
                                         adapter=req.adapter if planned.takes_slot else -1, state_from=planned.state_from,
                                         state_to=planned.state_to))
            tokens += [0] if planned.follows else planned.tokens  # the worker reads a follower's from its slot
            positions += range(planned.start, planned.start + n)
        width = max(len(p.request.pages) for p in plan.seqs)
        table = np.full((len(plan.seqs), width), -1, dtype=np.int32)  # [R, P]
        for row, planned in enumerate(plan.seqs):
            table[row, : len(planned.request.pages)] = planned.request.pages
        return protocol.Step(
            step_id=self.step_id,
            seqs=tuple(seqs),
            tokens=to_wire(np.asarray(tokens, dtype=np.int32)),
            positions=to_wire(np.asarray(positions, dtype=np.int32)),
            page_table=to_wire(table),
        )

    def stats(self) -> dict[str, object]:
        """The core's, and how many of the waiting requests wait because admission is held (paused,
        new weights or memory awaited: vLLM's reason "deferred") rather than for room to run
        (a slot, the step's token budget, KV pages: "capacity"); since when steps are in flight
        with no result absorbed (unset while none is), for liveness."""
        stats = self.core.stats()
        held = not (self.control.may_step and self.control.may_admit)
        awaiting = self.progress_at if self.in_flight else msgspec.UNSET
        return {**stats, "waiting_deferred": stats["waiting"] if held else 0, "awaiting_results_since": awaiting}

    def gateways(self) -> set[str]:
        """The gateways that have requests here."""
        return {r.gateway for r in self.core.running + self.core.waiting}

    def drop_gateway(self, gateway: str, out: Outbox) -> None:
        """A gateway died: nobody will read its requests' outputs, so stop computing them."""
        for request in self.core.running + self.core.waiting:
            if request.gateway == gateway:
                self.abort(request.rid, "gateway gone", out)

    def set_detokenizers(self, live: list[str], out: Outbox) -> None:
        """A detokenizer that died took its requests' text state: fail them (their clients get a
        503 or an SSE error event), those that ended here lately too (placements.py: their last
        output may have died with it); new requests go to the live ones."""
        held = set(self.core.rids())
        self.placements.refresh(held, time.monotonic())
        for rid, placement in self.placements.lost(set(live)):
            if rid in held:
                self.core.abort(rid)
            message = f"detokenizer {placement.detokenizer} stopped; the request was lost, retry it"
            out.replies.append((placement.gateway, protocol.RequestRejected(rid, 503, message)))
        self.detokenizers = live

    def reset(self) -> None:
        """Redis restarted: clients were told their requests failed; free everything, the prefix
        cache too (the step in flight, lost with Redis, never wrote its pages)."""
        self.core.invalidate_cache()
        for rid in self.core.rids():
            self.core.abort(rid)
        self.in_flight.clear()
        self.early.clear()
        self.tombstones.clear()
        self.control.names_lost = True  # the adapters' names went with Redis: written again from the registry

    def idle_check(self) -> None:
        """At idle, log a page leak once (the idle loop turns once a redis.block_ms: a lasting leak
        is not repeated), and again only if it changes."""
        if self.in_flight or self.core.rids():
            return  # not idle
        leak = self.core.check_idle()
        if leak and leak != self.leak_logged:
            log.error("page leak at idle: %s", leak)
        self.leak_logged = leak


class Peers:
    """Which gateways, detokenizers and workers are alive, looked up about once a heartbeat."""

    def __init__(self, bus: Bus, replica: int = 0) -> None:
        self.bus = bus
        self.replica = replica
        self.next_check = 0.0
        self.workers: set[str] = set()  # the replica's worker instances last seen alive

    async def update(self, service: SchedulerService, out: Outbox) -> None:
        # While the worker or every detokenizer is missing, look every iteration: a request or a
        # control message (a weight update) that arrives as one comes back must not be refused on a
        # view up to a heartbeat old (/health, which looks afresh, already says 200).
        if time.monotonic() < self.next_check and service.control.worker_up and service.detokenizers:
            return
        self.next_check = time.monotonic() + self.bus.cfg.heartbeat_ms / 1000
        try:
            live = await self.bus.live_names()
            dead = [g for g in service.gateways() - set(live) if not await self.bus.is_alive(g)]  # re-check: new since the scan?
        except TRANSIENT:
            return  # Redis is down: nothing to learn until it is back
        service.set_detokenizers(sorted(n for n in live if role_of(n) == "detokenizer"), out)
        workers = {n for n in live if role_of(n) == "worker" and replica_of(n) == self.replica}
        if self.workers - workers:  # one stopped (a new one starts with an empty KV cache)
            service.worker_lost(out)
        self.workers = workers
        service.control.worker_up = bool(workers)
        for gateway in dead:
            log.warning("gateway %s is gone: aborting its requests", gateway)
            service.drop_gateway(gateway, out)
