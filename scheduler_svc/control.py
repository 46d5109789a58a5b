"""What an RL loop asks of a replica between steps: pause and continue, weight updates, memory.

Pure, like the core it drives: messages in, replies and messages for the worker out (into the
service's Outbox); the service calls it from its loop. The rules:

1. Pause (`PauseGeneration`): `abort` ends every request (each answers with its partial output),
   `retract` sends the running ones back to waiting (KV to the cache or freed; recomputed after),
   `in_place` freezes them (KV kept). Either way no step is planned until `ContinueGeneration`;
   the steps already in flight finish and are absorbed. New requests wait at the gateway.
2. A weight update's `stage` and `discard` go to the worker at once: staging loads beside the live
   weights, so serving goes on meanwhile. Its `commit` waits until the replica is quiet (no step
   in flight, and no request running unless paused); until the worker answers, nothing is
   admitted. Running requests finish with the old weights first (SGLang's drain); frozen ones
   (in_place) go on with their KV after the swap. The worker's answer empties the prefix cache
   when asked: no later request reads KV the old weights computed (a frozen request's own pages
   are never cached).
3. Memory: `release` needs nothing running (the KV cache is lost): asked with requests running it
   is refused; the requests admitted while it waits for the steps in flight drain first. The
   prefix cache is emptied, and nothing steps until every tag is resumed. Weights come back
   without their values (worker_svc/control.py): until an update stages some and commits (the
   worker refuses one that leaves a tensor unset), nothing steps and new requests are refused
   with a 503 naming what to do; those already waiting (retracted by a pause) run after it.
4. A collective group (`WeightGroup`: join or leave the trainer's torch.distributed group) goes
   to the worker at once, as a stage does: it touches no live weight, and a join waits, beside the
   steps, for the trainer's other ranks. The tensors broadcast in it are a stage (rule 2).
5. LoRA adapters (adapters.py, the registry): a load takes a slot no request reads and goes to
   the worker at once (it writes that slot between steps: nothing waits, nothing drains); the name
   maps to it once the worker answers. An unload is the registry's alone: the name goes at once,
   its slot when the requests under it end. A worker that stops takes the adapters loaded since
   start with it (its successor loads worker.lora.adapters).
6. Every answer goes to the asking gateway as a ControlReply; a worker that stops fails what it
   was asked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
from typing import TYPE_CHECKING

from jaxstream import protocol
from jaxstream.english import counted
from scheduler_svc.adapters import AdapterRegistry
from scheduler_svc.core import Busy, Scheduler

if TYPE_CHECKING:
    from scheduler_svc.service import Outbox

log = logging.getLogger(__name__)

ToWorker = protocol.UpdateWeights | protocol.Memory | protocol.WeightGroup | protocol.LoadAdapter


class Control:
    def __init__(self, core: Scheduler, replica: int = 0, adapters: AdapterRegistry | None = None) -> None:
        self.core = core
        self.replica = replica
        self.adapters = adapters or AdapterRegistry(0)  # which adapter is in which worker slot
        self.paused: str | None = None  # the pause mode while paused
        self.released: set[str] = set()  # memory tags the worker has given back
        self.waiting: list[ToWorker] = []  # commits and releases, until the replica is quiet
        self.sent: dict[str, ToWorker] = {}  # relayed to the worker, by rid, until it answers
        self.worker_up = True  # as the service last saw it (a message for a dead worker would wait forever)
        self.weights_awaited = False  # resumed without their values, no update committed since
        self.staged = False  # some weights staged (and not discarded) since the last commit

    # -- what the loop may do

    @property
    def may_step(self) -> bool:
        """Not paused, nothing released, weights not awaited, no swap under way on the worker."""
        return self.paused is None and not self.released and not self.weights_awaited and not _commits(self.sent.values())

    def refusal(self) -> str | None:
        """Why a new request is refused (a 503), or None."""
        if self.weights_awaited:
            return (f"replica {self.replica}'s weights were resumed without their values (/resume_memory_occupation, "
                    "/wake_up): push them (/update_weights_from_tensor) or load a checkpoint (/update_weights_from_disk) first")
        return None

    @property
    def may_admit(self) -> bool:
        """Not while a commit or a release waits or runs: the requests running drain (new ones wait
        for the new weights, or for the memory to come back)."""
        return not self.waiting and not _commits(self.sent.values())

    # -- messages

    def pause(self, msg: protocol.PauseGeneration, abort_all: Callable[[str], int], out: Outbox) -> None:
        """`abort_all(reason)` ends every request the replica holds (the service's abort, which
        tells the detokenizer) and says how many. Pausing again applies the new mode (in_place then
        retract frees the frozen requests' KV)."""
        match msg.mode:
            case "abort":
                count = abort_all("aborted by /pause_generation")
            case "retract":
                count = self.core.retract_all()
            case _:  # in_place
                count = len(self.core.running)
        self.paused = msg.mode
        log.info("paused (%s): %s", msg.mode, counted(count, "request"))
        self._reply(out, msg, True, f"replica {self.replica} paused ({msg.mode}): {counted(count, 'request')}", requests=count)

    def resume(self, msg: protocol.ContinueGeneration, out: Outbox) -> None:
        was, self.paused = self.paused, None
        self._reply(out, msg, True, f"replica {self.replica} {'continues' if was else 'was not paused'}")

    def update(self, msg: protocol.UpdateWeights, out: Outbox) -> None:
        if msg.phase == "commit":
            self.waiting.append(msg)
        else:
            self._send(msg, out)

    def group(self, msg: protocol.WeightGroup, out: Outbox) -> None:
        self._send(msg, out)

    def load_adapter(self, msg: protocol.LoadAdapter, out: Outbox) -> None:
        try:
            slot = self.adapters.reserve(msg.name, self.adapters_in_use())
        except ValueError as exc:
            self._reply(out, msg, False, f"replica {self.replica}: {exc}")
            return
        self._send(msgspec.structs.replace(msg, slot=slot), out)
        if msg.rid not in self.sent:  # no worker to send it to
            self.adapters.failed(slot)

    def unload_adapter(self, msg: protocol.UnloadAdapter, out: Outbox) -> None:
        try:
            placed = self.adapters.unload(msg.name)
        except ValueError as exc:
            self._reply(out, msg, False, f"replica {self.replica}: {exc}")
            return
        users = sum(r.adapter == placed.slot for r in self.core.running + self.core.waiting)
        self._reply(out, msg, True, f"replica {self.replica}: adapter {msg.name!r} unloaded"
                    + (f"; its slot is freed once the requests under it end ({users} now)" if users else ""))

    def adapters_in_use(self) -> set[int]:
        """The adapter slots requests hold (running or waiting: a retracted one comes back to its slot)."""
        return {r.adapter for r in self.core.running + self.core.waiting if r.adapter >= 0}

    def memory(self, msg: protocol.Memory, out: Outbox) -> None:
        if not msg.release:
            self._send(msg, out)
            return
        if self.core.running:
            self._reply(out, msg, False, f"replica {self.replica}: {counted(len(self.core.running), 'request')} running "
                        "(their KV would be lost): pause with mode abort or retract, or wait for them, first")
            return
        self.waiting.append(msg)

    def tick(self, in_flight: int, out: Outbox) -> None:
        """Relay what waited for a quiet replica, once it is: the service calls this every
        iteration, after absorbing results."""
        if self.waiting and in_flight == 0 and (self.paused is not None or not self.core.running):
            for msg in self.waiting:
                if isinstance(msg, protocol.Memory) and self.core.running:  # frozen in place since it came: their KV would go
                    self._reply(out, msg, False, f"replica {self.replica}: {counted(len(self.core.running), 'request')} "
                                "frozen in place (paused in_place): their KV would be lost; pause with mode retract first")
                    continue
                self._send(msg, out)
            self.waiting = []
        if self.adapters.draining:
            self.adapters.sweep(self.adapters_in_use())

    def answered(self, reply: protocol.ControlReply, out: Outbox) -> None:
        """The worker's answer: act on it, then pass it to the gateway that asked."""
        msg = self.sent.pop(reply.rid, None)
        if msg is None:
            log.warning("control reply %s answers nothing asked (a worker before a restart?)", reply.rid)
            return
        requests = reply.requests
        if isinstance(msg, protocol.UpdateWeights):
            self._staging(msg.phase, reply.ok)
        if isinstance(msg, protocol.LoadAdapter):
            self._adapter_loaded(msg, reply.ok)
        if reply.ok:
            match msg:
                case protocol.UpdateWeights(phase="commit", flush_cache=flush):
                    requests = len(self.core.rids())
                    if flush:
                        self._forget_kv()
                case protocol.Memory(release=True, tags=tags):
                    self.released |= set(tags)
                    if "kv_cache" in tags:
                        self._forget_kv()
                case protocol.Memory(release=False, tags=tags):
                    self.weights_awaited |= "weights" in set(tags) & self.released
                    self.released -= set(tags)
        out.replies.append((msg.gateway, protocol.ControlReply(reply.rid, reply.ok, reply.message, self.replica, reply.weight_version,
                                                               reply.model_path, requests)))

    def worker_lost(self, out: Outbox) -> None:
        """What the worker was asked, and what waited for it, fails; a new one has all its memory."""
        for msg in [*self.sent.values(), *self.waiting]:
            self._reply(out, msg, False, f"replica {self.replica}'s worker stopped")
        self.sent, self.waiting, self.released = {}, [], set()
        self.adapters.reset()
        self.weights_awaited = self.staged = False  # a new worker loads its weights at start-up

    # -- internals

    def _staging(self, phase: str, ok: bool) -> None:
        """Follow the worker's staging: a stage done adds to it; a discard drops it, and so does a
        commit, done or failed (the worker drops its staging when one fails). A commit done with
        weights staged brought every value of awaited weights (the worker refuses one that would not)."""
        if phase == "stage":
            self.staged |= ok
            return
        if phase == "commit" and ok and self.staged:
            self.weights_awaited = False
        self.staged = False

    def _adapter_loaded(self, msg: protocol.LoadAdapter, ok: bool) -> None:
        """The worker wrote the slot (the name maps to it, under a new prefix cache namespace), or
        refused it (the slot is free again)."""
        if ok:
            placed = self.adapters.loaded(msg.slot, msg.path)
            log.info("adapter %r in slot %d (generation %d)", msg.name, placed.slot, placed.generation)
        else:
            self.adapters.failed(msg.slot)

    def _forget_kv(self) -> None:
        """Empty the prefix cache; with requests frozen in place, cut it off instead: their pages
        are freed when they end, never matched again."""
        try:
            pages = self.core.flush_cache(waiting_too=False)
            log.info("prefix cache flushed: %s freed", counted(pages, "page"))
        except Busy:
            self.core.invalidate_cache()
            log.info("prefix cache invalidated (requests frozen in place keep their own KV)")

    def _send(self, msg: ToWorker, out: Outbox) -> None:
        if not self.worker_up:
            self._reply(out, msg, False, f"replica {self.replica}'s worker is not running")
            return
        self.sent[msg.rid] = msg
        out.to_worker.append(msg)

    def _reply(self, out: Outbox, msg: protocol.PauseGeneration | protocol.ContinueGeneration | protocol.UnloadAdapter | ToWorker,
               ok: bool, message: str, requests: int = 0) -> None:
        out.replies.append((msg.gateway, protocol.ControlReply(msg.rid, ok, message, self.replica, requests=requests)))


def _commits(messages) -> bool:
    return any(isinstance(m, protocol.UpdateWeights) and m.phase == "commit" for m in messages)
