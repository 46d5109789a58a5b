"""The worker's side of weight updates and memory release: what its engine must do between steps.

The scheduler relays these in step order, only when no step is in flight for a commit or a
release (scheduler_svc/control.py), so the engine never swaps or frees what a step is using.
Staging runs beside the steps, in a thread of its own (`in_background`): it only reads the live
weights, so serving goes on while new ones load; what comes after waits for it (`lock`).

1. `stage` loads new weights beside the live ones: every tensor of a checkpoint on disk, the
   named tensors of one safetensors buffer that the gateway left in Redis, or those a trainer
   broadcasts in a collective group this worker joined (a bucket; several add up). Anything wrong
   (no such file, a missing tensor, a wrong shape or dtype, a trainer gone mid-bucket) fails the
   whole update, naming the tensor: what was staged is dropped and the old weights keep serving.
2. `commit` swaps the staged leaves in (same tree, shapes, dtypes and shardings: nothing
   recompiles) and sets the weight version; with nothing staged it sets the version only.
3. `release` frees the device buffers of the weights or the KV cache (the process and its compiled
   executables stay); `resume` gives the KV cache back empty, and the weights back without their
   values, as SGLang's resume does without a CPU backup: no checkpoint is read (the files the last
   weights came from may be gone: AReaL deletes each one once loaded) and no host copy was kept.
   The next update brings the values, staged straight into new buffers: a checkpoint from disk, or
   tensors pushed, every one of them (a commit that would leave one unset is refused, naming it).
   Until it commits, the scheduler steps nothing and refuses new requests with a 503
   (scheduler_svc/control.py, which follows the same messages).
4. `WeightGroup`: join the trainer's torch.distributed group as one receiving rank, or leave it
   (collective.py, which alone imports torch, loaded at the first join). Beside the steps and
   outside the weights' turn (`lock`): a join waits for every rank, and a leave may end a receive
   stuck on a trainer that is gone.

5. `LoadAdapter`: a LoRA adapter into the slot its scheduler chose (one no request reads: scheduler_svc/adapters.py),
   between steps: a PEFT directory on this machine, or the pushed tensors (the gateway left them in
   Redis) with the LoRA config beside them; read and checked before anything is written (a rank
   above worker.lora.max_rank, a module not targeted, a shape not this model's: refused, naming
   it), then written whole. Its `version`, if given, becomes the weight version.

What this asks of an engine (the JAX one or the fake), engine_api.py's StepEngine: stage_disk(path,
load_format), stage_tensors(pairs), commit_weights(), discard_weights(), release(tags),
resume_kv_cache(), weight_names(), load_adapter(slot, path), load_adapter_tensors(slot, config, tensors). A resume of the weights asks nothing of it: they stay released
there (a step refuses) until a commit swaps new ones in.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from jaxstream import protocol
from jaxstream.safetensors import SafetensorsError, decode
from jaxstream.transport import Bus
from worker_svc.engine_api import StepEngine
from worker_svc.weights import CheckpointError

log = logging.getLogger(__name__)

DEFAULT_VERSION = "default"  # SGLang's, before any update names one
Control = protocol.UpdateWeights | protocol.Memory | protocol.WeightGroup | protocol.LoadAdapter  # what the scheduler relays here


@dataclass(frozen=True)
class Source:
    """Where the live weights came from whole: a checkpoint, or random (dummy)."""

    path: str | None  # None: dummy
    load_format: str | None = None


class DeviceControl:
    def __init__(self, engine: StepEngine, bus: Bus, replica: int, source: Source) -> None:
        self.engine = engine
        self.bus = bus
        self.replica = replica
        self.source = source
        self.version = DEFAULT_VERSION
        self.staged: Source | None = None  # a whole checkpoint staged
        self.staged_tensors = 0  # tensors staged from buffers
        self.released: set[str] = set()
        # The weights were resumed without their values: the names of the tensors pushed since, or
        # None when they are not awaited
        self.awaited: set[str] | None = None
        self.lock = asyncio.Lock()
        self.groups = None  # the collective groups joined (collective.Groups), from the first join

    def stats(self) -> dict[str, str | int]:
        return {"weight_version": self.version, "model_path": self.model_path, "released": ",".join(sorted(self.released)),
                "rss_bytes": rss_bytes()}

    @property
    def model_path(self) -> str:
        return self.source.path or "dummy"

    @staticmethod
    def in_background(msg: object) -> bool:
        """Staging and collective groups run beside the steps (the live weights serve meanwhile, and
        a join or a receive waits on the trainer); the rest between them."""
        return isinstance(msg, protocol.UpdateWeights) and msg.phase == "stage" or isinstance(msg, protocol.WeightGroup)

    async def handle(self, msg: Control) -> protocol.ControlReply:
        if isinstance(msg, protocol.WeightGroup):  # beside the weights' turn: a join waits on the trainer, a leave ends a stuck receive
            return await self._handle(msg)
        async with self.lock:  # one at a time: a commit never overtakes the staging before it
            return await self._handle(msg)

    async def _handle(self, msg: Control) -> protocol.ControlReply:
        started = time.perf_counter()
        try:
            match msg:
                case protocol.UpdateWeights(phase="stage"):
                    message = await self._stage(msg)
                case protocol.UpdateWeights(phase="commit"):
                    message = await asyncio.to_thread(self._commit, msg)
                case protocol.UpdateWeights():  # discard
                    self._discard()
                    message = "staged weights dropped"
                case protocol.Memory(release=True, tags=tags):
                    message = await asyncio.to_thread(self._release, set(tags))
                case protocol.Memory(tags=tags):
                    message = await asyncio.to_thread(self._resume, set(tags))
                case protocol.WeightGroup(join=True):
                    message = await asyncio.to_thread(self.collective().join, msg)
                case protocol.WeightGroup(group=group):
                    message = await asyncio.to_thread(self.joined(group).leave, group)
                case protocol.LoadAdapter():
                    message = await self._load_adapter(msg)
        except (CheckpointError, SafetensorsError, ValueError) as exc:
            if isinstance(msg, protocol.UpdateWeights):
                self._discard()
            log.warning("%s refused: %s", type(msg).__name__, exc)
            return self._reply(msg, False, str(exc))
        except Exception as exc:  # noqa: BLE001 - the worker keeps serving on its live weights
            if isinstance(msg, protocol.UpdateWeights):
                self._discard()
            log.exception("%s failed", type(msg).__name__)
            return self._reply(msg, False, f"the worker failed: {type(exc).__name__}: {exc}")
        log.info("%s in %.2f s: %s", type(msg).__name__, time.perf_counter() - started, message)
        return self._reply(msg, True, message)

    async def _stage(self, msg: protocol.UpdateWeights) -> str:
        if msg.broadcast is not None:
            count = await asyncio.to_thread(self._receive, msg.broadcast)
            self.staged_tensors += count
            return f"{count} tensors received in group {msg.broadcast.group!r} and staged ({self.staged_tensors} in all)"
        self._check_weights_held()
        if msg.path is not None:
            count = await asyncio.to_thread(self.engine.stage_disk, msg.path, msg.load_format)
            self.staged, self.staged_tensors = Source(msg.path, msg.load_format), 0
            return f"{count} parameters staged from {msg.path}"
        data = await self.bus.get_blob(msg.blobs)
        if data is None:
            raise ValueError("the tensors' bytes expired in Redis before the worker read them")
        tensors = decode(data)
        count = await asyncio.to_thread(self.engine.stage_tensors, tensors)
        self.staged_tensors += count
        if self.awaited is not None:
            self.awaited |= {name for name, _ in tensors}
        return f"{count} tensors staged ({self.staged_tensors} in all)"

    async def _load_adapter(self, msg: protocol.LoadAdapter) -> str:
        self._check_weights_held()
        if msg.path:
            rank = await asyncio.to_thread(self.engine.load_adapter, msg.slot, msg.path)
        else:
            tensors = []
            for parts in msg.blobs:
                data = await self.bus.get_blob(parts)
                if data is None:
                    raise ValueError("the adapter's bytes expired in Redis before the worker read them")
                tensors += decode(data)
            config = {"r": msg.rank, "lora_alpha": msg.alpha, "target_modules": list(msg.target_modules), "use_rslora": msg.use_rslora}
            rank = await asyncio.to_thread(self.engine.load_adapter_tensors, msg.slot, config, tensors)
        if msg.version is not None:
            self.version = msg.version
        return f"adapter {msg.name!r} (rank {rank}) in slot {msg.slot}; weight version {self.version!r}"

    def _receive(self, broadcast: protocol.Broadcast) -> int:
        """Stage the tensors as they arrive; refused or not, the whole bucket is received (the
        trainer's broadcast ends)."""
        with self.joined(broadcast.group).receiving(broadcast) as tensors:
            self._check_weights_held()
            count = self.engine.stage_tensors(tensors)
        if self.awaited is not None:
            self.awaited |= set(broadcast.names)
        return count

    def collective(self):
        """The collective groups (worker_svc/collective.py), loading torch the first time."""
        if self.groups is None:
            try:
                from worker_svc.collective import Groups
            except ModuleNotFoundError as exc:
                raise ValueError(f"collective weight sync needs torch on the worker ({exc}): pip install 'jaxstream[rl]'") from None
            self.groups = Groups(self.replica)
        return self.groups

    def joined(self, group: str):
        """The collective groups, to use `group`: before any join, the refusal (torch not loaded for it)."""
        if self.groups is None:
            raise ValueError(no_group(group))
        return self.groups

    def _check_weights_held(self) -> None:
        if "weights" in self.released:
            raise ValueError("the weights are released: /resume_memory_occupation with tag 'weights' first")

    def _commit(self, msg: protocol.UpdateWeights) -> str:
        swapped = ""
        if self.staged is not None or self.staged_tensors:
            self._check_whole()
            count = self.engine.commit_weights()
            if self.staged is not None:
                self.source = self.staged
            self.awaited = None
            swapped = f"{count} parameters swapped; "
        self.staged, self.staged_tensors = None, 0
        if msg.version is not None:
            self.version = msg.version
        return f"{swapped}weight version {self.version!r}"

    def _check_whole(self) -> None:
        """While the weights' values are awaited, an update must bring every tensor (a checkpoint
        does): a tensor left unset would serve zeros, or freed memory."""
        if self.awaited is None or self.staged is not None:
            return
        unset = [name for name, _, _ in self.engine.weight_names() if name not in self.awaited]
        if unset:
            raise ValueError(f"the weights were resumed without their values, and this update leaves {len(unset)} of their "
                             f"tensors unset ({', '.join(unset[:3])}{', ...' if len(unset) > 3 else ''}): push every tensor, "
                             "or load a checkpoint (/update_weights_from_disk)")

    def _discard(self) -> None:
        self.engine.discard_weights()
        self.staged, self.staged_tensors = None, 0
        if self.awaited is not None:  # what was staged is gone: its tensors are awaited again
            self.awaited = set()

    def _release(self, tags: set[str]) -> str:
        self._discard()
        self.engine.release(tags - self.released)
        self.released |= tags
        if "weights" in tags:
            self.awaited = None  # the values are gone either way: the resume awaits them
        return f"released: {', '.join(sorted(tags))}"

    def _resume(self, tags: set[str]) -> str:
        notes = []
        if "kv_cache" in tags & self.released:
            self.engine.resume_kv_cache()
        if "weights" in tags & self.released:
            self.awaited = set()
            notes.append("the weights' values are awaited: push them (every tensor) or load a checkpoint before generating")
        self.released -= tags
        return "; ".join([f"resumed: {', '.join(sorted(tags))}", *notes])

    def _reply(self, msg: Control, ok: bool, message: str) -> protocol.ControlReply:
        return protocol.ControlReply(msg.rid, ok, message, self.replica, self.version, self.model_path)


def no_group(group: str) -> str:
    return f"no group {group!r} here: /init_weights_update_group (or /init_weight_transfer_engine) first"


def rss_bytes() -> int:
    """This process's resident memory (what a released CPU device gives back shows here); 0 where
    /proc is not."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")
