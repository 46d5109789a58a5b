"""One request's life as the gateway sees it: submit, receive outputs, abort if left early."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from gateway.admission import Admission
from gateway.errors import ApiError
from gateway.experts import routed_layout
from gateway.gate import Gate
from gateway.metrics import Group, Metrics
from gateway.replicas import Replicas
from gateway.replies import Lost, ReplyRouter
from gateway.watchdog import Watchdog, starting_labels, unavailable_message
from jaxstream import protocol
from jaxstream.config import ServerConfig
from jaxstream.names import replica_of, role_of
from jaxstream.transport import Bus, StreamMissing

log = logging.getLogger(__name__)

TOKENIZER_TIMEOUT_S = 30.0
DEFAULT_WEIGHT_VERSION = "default"  # SGLang's, before an update names one
FLUSH_TIMEOUT_S = 10.0  # a live scheduler answers a flush within one loop iteration
# A scheduler asked to write its stats answers within one loop iteration too; one that does not (stuck,
# or gone since its last heartbeat) leaves its last written stats to be read.
STATS_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class ServedModel:
    """What the live services report of the model they serve, in their heartbeat stats: a worker's
    (its model's facts, its weights' version and source) and a tokenizer's facts; None while no
    live instance of the role has reported."""

    worker: protocol.WorkerStats | None
    tokenizer: protocol.TokenizerFacts | None

    @property
    def facts(self) -> protocol.ModelFacts | None:
        return self.worker.facts if self.worker else None

    @property
    def weight_version(self) -> str:
        return (self.worker.weight_version if self.worker else "") or DEFAULT_WEIGHT_VERSION

    @property
    def model_path(self) -> str | None:
        """Where the live weights last came from whole ("dummy": random)."""
        return self.worker.model_path if self.worker else None

    @property
    def max_model_len(self) -> int | None:
        return self.tokenizer.max_model_len if self.tokenizer else None


@dataclass
class Result:
    """The whole output of a request, accumulated from its RequestOutputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: protocol.FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    token_texts: list[str] = field(default_factory=list)
    token_raws: list[bytes | None] = field(default_factory=list)
    top_logprobs: list[tuple[protocol.TokenLogprob, ...]] = field(default_factory=list)
    prompt_logprobs: list[protocol.TokenLogprob] = field(default_factory=list)
    prompt_top_logprobs: list[tuple[protocol.TokenLogprob, ...]] = field(default_factory=list)
    # [version, first output token, end]: which weights computed which output tokens, in order
    weight_spans: list[list] = field(default_factory=list)
    routed_experts: protocol.Array | None = None  # [n, L, k] int32, with the last output, when asked
    # per output token / scored prompt position: the logprobs of the request's token_ids_logprob
    token_ids_logprobs: list[tuple[protocol.TokenLogprob, ...]] = field(default_factory=list)
    prompt_token_ids_logprobs: list[tuple[protocol.TokenLogprob, ...]] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)  # per prompt_logprobs entry (0: position 0)
    prompt_token_ids: list[int] = field(default_factory=list)  # the prompt as run, when asked
    channels: list[protocol.ChannelText] = field(default_factory=list)  # a Harmony chat's text by channel (SamplingParams.channels)

    def add(self, out: protocol.RequestOutput) -> None:
        if out.token_ids and out.weight_version:
            start = len(self.token_ids)
            if self.weight_spans and self.weight_spans[-1][0] == out.weight_version and self.weight_spans[-1][2] == start:
                self.weight_spans[-1][2] += len(out.token_ids)
            else:
                self.weight_spans.append([out.weight_version, start, start + len(out.token_ids)])
        self.text += out.text
        self.channels += out.channels
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.token_texts += out.token_texts
        self.token_raws += out.token_raws or [None] * len(out.token_texts)
        self.top_logprobs += out.top_logprobs
        self.prompt_logprobs += out.prompt_logprobs
        self.prompt_top_logprobs += out.prompt_top_logprobs
        self.token_ids_logprobs += out.token_ids_logprobs
        self.prompt_token_ids_logprobs += out.prompt_token_ids_logprobs
        self.prompt_ranks += out.prompt_ranks
        self.prompt_token_ids += out.prompt_token_ids
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = out.completion_tokens or self.completion_tokens
        self.cached_tokens = out.cached_tokens or self.cached_tokens
        if out.finish is not None:
            self.finish = out.finish
        if out.routed_experts is not None:
            self.routed_experts = out.routed_experts


class Pipeline:
    """The pipeline behind this gateway, as calls: `stream(request)` yields RequestOutputs;
    `tokenize` and `detokenize` ask the tokenizer service. Each generation runs on the replica
    `replicas` chooses; its aborts go there."""

    def __init__(self, bus: Bus, router: ReplyRouter, watchdog: Watchdog, replicas: Replicas, metrics: Metrics,
                 chars_per_token: int = ServerConfig.max_chars_per_token) -> None:
        self.bus = bus
        self.gate = Gate(bus)
        self.admission = Admission(self.max_model_len, self.scheduler_stats, chars_per_token)
        self.router = router
        self.watchdog = watchdog
        self.replicas = replicas
        self.metrics = metrics
        self._aborts: set[asyncio.Task] = set()
        self.version_seen = ""  # the weight version of the latest output or update seen here
        self.draining = False  # SIGTERM: no new generation enters, those in flight finish (__main__.py)

    def new_rid(self) -> str:
        return uuid.uuid4().hex

    async def _check_up(self) -> None:
        """A 503 when a role every request needs has no live instance, saying whether it is starting.
        While some role or replica is missing, look again first: it may have just started (the
        watchdog's own look is up to a heartbeat old, and /health, which said ready, looks afresh)."""
        if self.watchdog.unavailable() or len(self.watchdog.up) < self.replicas.count:
            await self.watchdog.look()
            if missing := self.watchdog.unavailable():
                starting = starting_labels(await self.bus.starting(), self.replicas.count)
                raise ApiError(503, unavailable_message(missing, starting))

    def stream(self, rid: str, sampling: protocol.SamplingParams, group: Group | None = None,
               **prompt) -> AsyncIterator[protocol.RequestOutput]:
        """Raises ApiError for a rejected request (before any output). Leaving the iteration
        before the final output (client gone, error) aborts the request in the pipeline. `group`:
        the metrics' group of the prompt's n samples this is one of; None: a group of its own."""
        group = group or self.metrics.group(1, sampling.max_new_tokens)
        return self.metrics.track(self._stream(rid, sampling, **prompt), group)

    def in_flight(self) -> int:
        """Generations through this gateway not finished yet: in the pipeline, or held at the gate."""
        return sum(self.replicas.in_flight) + self.gate.held

    async def _stream(self, rid: str, sampling: protocol.SamplingParams, **prompt) -> AsyncIterator[protocol.RequestOutput]:
        if self.draining:
            raise ApiError(503, "the server is shutting down: it finishes the requests it has and takes no new one")
        await self._check_up()
        await self.admission.check_prompt(prompt)  # a prompt too long for any tokenizer to bother with: a 400
        await self.gate.enter()  # paused, or weights being swapped: wait; memory released: a 503
        if not self.watchdog.up:  # the last replica went down meanwhile (the checks above await)
            await self._check_up()  # a 503 naming what is missing
            raise ApiError(503, "service unavailable: no replica has its scheduler and worker running")
        check_rid_free(self.router, rid)
        with_room = await self.admission.with_room(self.watchdog.up)  # every queue full: a 503, before the tokenizer
        queue = self.router.open(rid)
        replica = self.replicas.assign(rid, with_room)
        finished = False
        try:
            request = protocol.GenerateRequest(rid=rid, gateway=self.bus.name, sampling=sampling, **prompt, replica=replica)
            try:
                await self.bus.publish(self.bus.keys.tokenizer, request, wait_for_redis=False)
            except StreamMissing:
                finished = True  # never entered the pipeline
                raise ApiError(503, "the tokenizer service is not running") from None
            while True:
                match await queue.get():
                    case protocol.RequestRejected() as rejected:  # refused; held nowhere
                        finished = True
                        raise ApiError(rejected.status, rejected.message, rejected.param, rejected.code)
                    case Lost(message=message):  # `finished` stays False: abort what may remain
                        raise ApiError(503, message)
                    case protocol.RequestOutput(finish=protocol.FinishReason(type="error", message=message)):
                        finished = True  # ended in the pipeline by a failure (its worker died): a 503
                        raise ApiError(503, message or "the request failed in the pipeline")
                    case protocol.RequestOutput() as out:
                        finished = out.finish is not None
                        self.version_seen = out.weight_version or self.version_seen
                        yield out
                        if finished:
                            return
        finally:
            self.router.close(rid)
            self.replicas.release(rid)
            if not finished:
                self.abort(rid, "client disconnected", replica)

    async def tokenize(self, **fields) -> protocol.TokenizeReply:
        """Text or chat messages to ids, by the tokenizer service (fields of TokenizeRequest)."""
        return await self._tokenizer(protocol.TokenizeRequest(self.new_rid(), self.bus.name, **fields))

    async def detokenize(self, token_ids: tuple[int, ...], skip_special_tokens: bool = True) -> str:
        reply = await self._tokenizer(protocol.DetokenizeRequest(self.new_rid(), self.bus.name, token_ids, skip_special_tokens))
        return reply.text or ""

    async def _tokenizer(self, request: protocol.TokenizeRequest | protocol.DetokenizeRequest) -> protocol.TokenizeReply:
        """A round trip to the tokenizer service (the gateway never touches a tokenizer)."""
        await self._check_up()
        queue = self.router.open(request.rid)
        try:
            try:
                await self.bus.publish(self.bus.keys.tokenizer, request, wait_for_redis=False)
            except StreamMissing:
                raise ApiError(503, "the tokenizer service is not running") from None
            return await _answer(queue, protocol.TokenizeReply, TOKENIZER_TIMEOUT_S, "the tokenizer service")
        finally:
            self.router.close(request.rid)

    async def model_facts(self) -> ServedModel:
        """What the services know of the model, from their heartbeat stats: the tokenizer's
        max_model_len, vocab_size, ...; the worker's model facts and weights."""
        stats = await self.bus.get_stats(("tokenizer", "worker"))
        worker = next((s for s in stats["worker"].values() if isinstance(s, protocol.WorkerStats)), None)
        tokenizer = next((s for s in stats["tokenizer"].values() if isinstance(s, protocol.TokenizerStats)), None)
        return ServedModel(worker, tokenizer.facts if tokenizer else None)

    async def routed_layout(self) -> tuple[int, int]:
        """(layers, experts per token) for a request asking for routed experts; a 400 when it cannot."""
        return routed_layout((await self.model_facts()).facts)

    async def weight_version(self) -> str:
        """The weights' version now, as the workers report it."""
        return (await self.model_facts()).weight_version

    async def current_version(self) -> str:
        """The version of the weights producing tokens now, without asking Redis once one was seen."""
        if not self.version_seen:
            self.version_seen = await self.weight_version()
        return self.version_seen

    async def max_model_len(self) -> int | None:
        return (await self.model_facts()).max_model_len

    async def scheduler_stats(self, fresh: bool = True) -> list[tuple[int, protocol.SchedulerStats]]:
        """(replica, stats) of each live scheduler that published them, by replica: current (write_stats),
        or as last written (`fresh` False: up to a heartbeat old, without a round trip to them)."""
        if fresh:
            await self.write_stats()
        stats = (await self.bus.get_stats(("scheduler",)))["scheduler"]
        return sorted(((replica_of(name) or 0, s) for name, s in stats.items() if isinstance(s, protocol.SchedulerStats)),
                      key=lambda item: item[0])

    async def write_stats(self) -> None:
        """Have every live scheduler write its stats now (protocol.WriteStats), for a client's read to
        count every request it saw end. A scheduler silent for STATS_TIMEOUT_S is not waited for."""
        async with self._ask_live_schedulers(lambda rid: protocol.WriteStats(rid, self.bus.name)) as (queue, asked):
            try:
                async with asyncio.timeout(STATS_TIMEOUT_S):
                    for _ in range(asked):
                        await queue.get()
            except TimeoutError:
                pass  # the stats it last wrote are read

    async def flush_cache(self) -> list[protocol.FlushCacheReply]:
        """Ask every live scheduler to empty its prefix cache; their answers, by replica. A replica
        whose scheduler is not running has no cache (a new one starts empty)."""
        async with self._ask_live_schedulers(lambda rid: protocol.FlushCache(rid, self.bus.name)) as (queue, asked):
            if not asked:
                raise ApiError(503, "service unavailable: no scheduler running")
            return [await _answer(queue, protocol.FlushCacheReply, FLUSH_TIMEOUT_S, "a scheduler asked to flush")
                    for _ in range(asked)]

    @contextlib.asynccontextmanager
    async def _ask_live_schedulers(self, message: Callable[[str], protocol.SchedulerInput]) -> AsyncIterator[tuple[asyncio.Queue, int]]:
        """Send `message(rid)` to every live scheduler; yields the queue their answers reach and how
        many were asked (a scheduler that stopped meanwhile was not)."""
        live = await self.bus.live_names()
        replicas = sorted({replica_of(n) or 0 for n in live if role_of(n) == "scheduler"})
        rid = self.new_rid()
        queue = self.router.open(rid)
        try:
            items = [(self.bus.keys.scheduler(r), message(rid)) for r in replicas]
            missing = await self.bus.publish_many(items, wait_for_redis=False) if items else []
            yield queue, len(replicas) - len(missing)
        finally:
            self.router.close(rid)

    async def control(self, message: Callable[[str], protocol.SchedulerInput], timeout_s: float,
                      roles: tuple[str, ...] = ("scheduler",)) -> list[protocol.ControlReply]:
        """Ask every replica's scheduler (every replica's `roles` must be running: a control message
        changes them all or none) with `message(rid)`; their answers, by replica."""
        names = await self.bus.live_names()
        for role in roles:
            live = {replica_of(n) or 0 for n in names if role_of(n) == role}
            if missing := [r for r in range(self.replicas.count) if r not in live]:
                raise ApiError(503, f"replica {', '.join(map(str, missing))}'s {role} is not running: "
                                    "every replica must take this, or none")
        rid = self.new_rid()
        queue = self.router.open(rid)
        try:
            if await self.bus.publish_many([(s, message(rid)) for s in self._schedulers()], wait_for_redis=False):
                raise ApiError(503, "a scheduler stopped meanwhile; nothing was asked of it")
            replies = [await _answer(queue, protocol.ControlReply, timeout_s, "a scheduler") for _ in range(self.replicas.count)]
            return sorted(replies, key=lambda r: r.replica)
        finally:
            self.router.close(rid)

    def _schedulers(self) -> list[str]:
        return [self.bus.keys.scheduler(r) for r in range(self.replicas.count)]

    async def abort_all(self, reason: str) -> None:
        """Every request every replica's scheduler holds, whichever gateway sent it."""
        message = protocol.AbortRequests((), reason, abort_all=True)
        await self.bus.publish_many([(stream, message) for stream in self._schedulers()], wait_for_redis=False)

    def abort(self, rid: str, reason: str, replica: int | None = None) -> None:
        """To the replica running the request; one this gateway does not know of (sent through
        another gateway, or not started yet) to every replica: those that do not hold it keep a
        tombstone for a while, in case it is on its way."""
        replica = self.replicas.replica_of(rid) if replica is None else replica
        streams = self._schedulers() if replica is None else [self.bus.keys.scheduler(replica)]
        message = protocol.AbortRequests((rid,), reason)
        # A task, not an await: this runs in `finally` of a cancelled handler too.
        task = asyncio.create_task(self.bus.publish_many([(s, message) for s in streams], wait_for_redis=False))
        self._aborts.add(task)
        task.add_done_callback(self._abort_sent)

    def _abort_sent(self, task: asyncio.Task) -> None:
        self._aborts.discard(task)
        if not task.cancelled() and task.exception() is not None:  # Redis down: its state goes anyway
            log.warning("abort not sent: %s", task.exception())


def check_rid_free(router: ReplyRouter, rid: str) -> None:
    if rid in router.queues:
        raise ApiError(400, f"Duplicate request ID '{rid}': it is already in use by a running request", "rid")


async def gather(outputs: AsyncIterator[protocol.RequestOutput]) -> Result:
    """A request's outputs added up, for a response that is not streamed."""
    result = Result()
    async for out in outputs:
        result.add(out)
    return result


async def _answer(queue: asyncio.Queue, expected: type, timeout_s: float, who: str):
    """The next reply of a round trip through the reply router: one of type `expected`, or an
    ApiError: 503 when `who` is silent for `timeout_s` or the pipeline lost the exchange, a refusal's
    own status, 500 for anything else."""
    try:
        reply = await asyncio.wait_for(queue.get(), timeout_s)
    except TimeoutError:
        raise ApiError(503, f"{who} did not answer within {timeout_s:g} s") from None
    match reply:
        case protocol.RequestRejected() as rejected:
            raise ApiError(rejected.status, rejected.message, rejected.param, rejected.code)
        case Lost(message=message):
            raise ApiError(503, message)
        case _ if isinstance(reply, expected):
            return reply
        case _:
            raise ApiError(500, f"unexpected reply {type(reply).__name__}")
