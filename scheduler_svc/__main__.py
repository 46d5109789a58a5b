"""scheduler_svc: decides what runs. Pure policy in `core.py`, this file is the loop around it.

1. Read, in one blocking read, new requests, aborts and stop-string finishes (this replica's
   scheduler stream) and the worker's step results (the replica's results stream, read by the
   detokenizers too). Scheduler r and worker r (`parallelism.replica`) are one data-parallel
   replica with streams of its own; the gateway chose the replica of each request.
2. Take them: admit (a 503 when scheduler.max_queued_requests already wait), abort (a tombstone
   when the request has not arrived yet; `abort_all` ends every request held; a request none of
   whose tokens reached the model ends "Abort before prefill: ..."), absorb sampled tokens; a
   finished request gives its whole pages to the prefix cache and frees the rest (the detokenizer
   reaches the same verdict itself); /flush_cache empties the cache, or answers why not (requests
   running or waiting), on the asking gateway's stream.
3. Plan the next step when fewer than two are in flight (overlap; one with scheduler.overlap=false)
   and publish it to the replica's worker stream, after the request events (whose starts name the replica, for a stop string's finish to come back; a
   request's cache hit goes with its first step, for the client's `cached_tokens`). Results are
   absorbed in step order, checked by step id (service.py: one delivered twice is ignored, one that
   comes early waits for the older one's, and one lost for good fails its step's requests).
4. Keep stats for the gateway (loads, counters, since when steps have been in flight without a
   result, which /health and `jaxstream up` call a stall past server.scheduler_stall_s, and
   histograms of request phases and step sizes
   timed here with the service's clock: jaxstream/histogram.py): written with the heartbeat, and
   when a gateway asks (WriteStats, before it reads them for a client) in the same round trip as the
   answer: a client that has its whole response and reads /metrics sees it gone. At idle, check that
   every page is free or held by the prefix cache (a leak is logged once while it lasts).
5. About once a heartbeat, look up the live peers (an idle loop still turns once a redis.block_ms,
   or a dead detokenizer's ended requests would wait for the next message to be failed): requests
   are spread over the live detokenizers (each has its own event stream); the requests of a gateway
   whose heartbeat expired are aborted, and those of a detokenizer that died are failed (its text
   state is gone). When the replica's worker stops, the KV the prefix cache names is gone with it,
   and so are the steps it had not answered: the cache forgets it, the steps are forgotten, and the
   requests that ran on it end with an error (a 503 to their clients). Not once the scheduler is
   stopping itself: its peers stop with it (`jaxstream up` stops the gateway first), and their
   ended heartbeats are no deaths to fail requests for or warn about.
6. If Redis restarts, every request is gone with it: abort them all, empty the cache, start clean;
   the LoRA adapters' names, gone too, are written again from the registry (control.py, 5.).
7. RL control (control.py): pause (abort, retract or in place) and continue; a weight update's
   stage goes to the worker at once, its commit once the replica is quiet (running requests drained,
   none admitted meanwhile), then the prefix cache is emptied; memory release and resume. Every
   answer goes back to the asking gateway. LoRA adapters: at start, the registry takes those a
   predecessor loaded from a path (the names every gateway reads) and loads them again; a new
   worker gets them again too (control.py, 5.).
"""

from __future__ import annotations

from jaxstream import architectures, protocol
from jaxstream.config import AppConfig
from jaxstream.kv_memory import state_snapshots
from jaxstream.preflight import model_numbers
from jaxstream.service import run
from jaxstream.transport import TRANSIENT, Bus
from scheduler_svc.adapters import AdapterRegistry
from scheduler_svc.core import Scheduler
from scheduler_svc.ngram import NgramDrafter
from scheduler_svc.pages import PageAllocator
from scheduler_svc.radix import prefix_cache
from scheduler_svc.service import Outbox, Peers, SchedulerService

INBOX = protocol.SchedulerInput | protocol.WorkerOutput


async def main(cfg: AppConfig, bus: Bus) -> None:
    s = cfg.scheduler
    pages = PageAllocator(s.num_pages)
    # A hybrid's running requests each hold a state slot, and its prefix cache keeps the worker's
    # state snapshots (snapshots.py); the fake worker keeps no state.
    hybrid = architectures.hybrid(model_numbers(cfg)[1]) is not None
    snapshots = state_snapshots(cfg) if hybrid and cfg.worker.kind == "jax" else None
    core = Scheduler(max_running=s.max_running_requests, token_budget=s.max_tokens_per_step, page_size=s.page_size,
                     allocator=pages, max_queued=s.max_queued_requests,
                     cache=prefix_cache(s.page_size, pages, s.prefix_cache, snapshots), policy=s.policy,
                     drafter=NgramDrafter.configured(s), state_slots=hybrid)
    replica = cfg.parallelism.replica
    # A detokenizer's death is seen a heartbeat TTL late at worst: keep where ended requests went that long.
    keep_s = (cfg.redis.heartbeat_ttl_ms + 2 * cfg.redis.heartbeat_ms) / 1000
    # A result lagging a later one for a heartbeat TTL is lost (service.py): the gateway fails the
    # requests of a Redis unreachable that long anyway.
    lora = cfg.worker.lora  # the worker's adapter slots, and the adapters it loads at start
    adapters = AdapterRegistry(lora.max_adapters, {n: (slot, lora.adapters[n]) for n, slot in lora.start_slots().items()})
    service = SchedulerService(core, replica, overlap=s.overlap, keep_placements_s=keep_s,
                               result_wait_s=cfg.redis.heartbeat_ttl_ms / 1000, adapters=adapters)
    recovered = Outbox()  # the adapters a predecessor loaded at run time (control.py, 5.)
    service.control.recover(await bus.adapters(), recovered)
    inbox = bus.consumer([bus.keys.scheduler(replica), bus.keys.results(replica)], protocol.decoder(INBOX))
    await inbox.ensure_groups(from_start=False)
    bus.stats = protocol.SchedulerStats(**service.stats())
    bus.on_restart(service.reset)
    await write_adapter_names(bus, recovered)
    bus.start_heartbeat()
    peers = Peers(bus, replica)
    async for batch in inbox.batches(idle=True):  # peers are looked up while nothing comes too (5.)
        out = Outbox()
        if not bus.closing:  # stopping, peers that stop too are not deaths to act on (5.)
            await peers.update(service, out)
        service.take([message for _, message in batch], out)
        service.plan(out)
        bus.stats = protocol.SchedulerStats(**service.stats())
        await publish(bus, out, replica, with_stats=out.write_stats)
        try:
            await write_adapter_names(bus, out)
        except TRANSIENT:  # written whole once Redis answers (a name left over meanwhile: the scheduler's 404)
            service.control.names_lost = True
        service.idle_check()


async def publish(bus: Bus, out: Outbox, replica: int, with_stats: bool = False) -> None:
    items: list[tuple[str, object]] = [(bus.keys.gateway(gw), reply) for gw, reply in out.replies]
    items += [(bus.keys.detokenizer(name), events) for name, events in out.events().items()]
    items += [(bus.keys.worker(replica), message) for message in [*out.steps, *out.to_worker]]
    await bus.publish_many(items, with_stats=with_stats)


async def write_adapter_names(bus: Bus, out: Outbox) -> None:
    """The adapters' names every gateway reads, as the registry changed them (control.py, 5.)."""
    for name, path in out.adapter_names.items():
        await bus.put_adapter(name, path)
    for name in out.adapters_gone:
        await bus.delete_adapter(name)


if __name__ == "__main__":
    run("scheduler", main)
