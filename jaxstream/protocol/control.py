"""Control: the gateway asks every replica's scheduler; a scheduler relays what concerns the device
(UpdateWeights, Memory, WeightGroup) to its worker in step order, and every answer is a ControlReply
(a FlushCacheReply for a flush) to the asking gateway: a worker's goes through its scheduler, which
acts on it first."""

from __future__ import annotations

import msgspec


class FlushCache(msgspec.Struct, frozen=True, tag=True):
    """/flush_cache: empty the prefix cache if no request runs or waits (never aborting one).
    Answered with a FlushCacheReply on the gateway's stream."""

    rid: str  # of the exchange, for the gateway to route the reply
    gateway: str


class FlushCacheReply(msgspec.Struct, frozen=True, tag=True):
    """One replica's answer to a FlushCache: flushed, or why not (requests running or waiting)."""

    rid: str
    flushed: bool
    message: str = ""


class WriteStats(msgspec.Struct, frozen=True, tag=True):
    """Write your stats now, then answer (a ControlReply on the gateway's stream). Sent before
    /metrics, /stats and /v1/loads read the stats. What a client saw end before it asked is older
    than this message on the streams the scheduler reads in one read (its stop request on the
    scheduler stream, its step result on the results stream, which never holds more than the two
    steps in flight), so the stats written with the answer count it."""

    rid: str
    gateway: str


PAUSE_MODES = ("abort", "retract", "in_place")


class PauseGeneration(msgspec.Struct, frozen=True, tag=True):
    """/pause_generation on one replica: `abort` ends every request it holds (with its partial
    output), `retract` sends running requests back to waiting (their KV freed, recomputed on
    continue), `in_place` stops stepping (KV kept). Then no step runs until ContinueGeneration."""

    rid: str
    gateway: str
    mode: str = "abort"  # one of PAUSE_MODES


class ContinueGeneration(msgspec.Struct, frozen=True, tag=True):
    rid: str
    gateway: str


WEIGHT_PHASES = ("stage", "commit", "discard")
LOAD_FORMATS = ("auto", "safetensors", "gguf")  # SGLang's load_format names, of those a worker reads


# A broadcast tensor's dtype, as torch names it (`str(tensor.dtype)` less "torch."), and its bytes
# per element: what a receiving rank allocates before the trainer's broadcast fills it.
WIRE_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1}
GROUP_BACKENDS = ("gloo", "nccl")  # torch.distributed's: gloo between CPUs, NCCL between GPUs
PACKED_WHOLE = -1  # Broadcast.packing: the whole bucket as one uint8 buffer (SGLang's flattened_bucket)


class Broadcast(msgspec.Struct, frozen=True):
    """Tensors a trainer broadcasts from rank 0 of a collective group (WeightGroup), in this order,
    each in Hugging Face name and layout. `packing` 0: one broadcast per tensor (SGLang's default,
    vLLM's unpacked); PACKED_WHOLE: the bytes of them all, concatenated, in one uint8 broadcast;
    n > 0: vLLM's packed buffers, each the tensors that follow until their bytes pass n."""

    group: str
    names: tuple[str, ...]
    dtypes: tuple[str, ...]  # each a key of WIRE_DTYPES
    shapes: tuple[tuple[int, ...], ...]
    packing: int = 0


class UpdateWeights(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """One phase of a weight update on one replica, relayed by the scheduler to its worker.

    `stage` loads new weights beside the live ones (from `path`, the safetensors bytes in `blobs`,
    or the tensors a trainer broadcasts in a collective group, several stages adding up), checked,
    while the old weights keep serving; `commit`
    swaps them in once no step is in flight and no request runs (paused ones excepted), then sets
    `version` and flushes the prefix cache; `discard` drops what was staged. A commit with nothing
    staged changes the version only. Every replica stages before any commits: all or none swap."""

    rid: str
    gateway: str
    phase: str  # one of WEIGHT_PHASES
    path: str | None = None  # stage: a checkpoint (Hugging Face directory, GGUF file)
    load_format: str | None = None  # stage from path: None or one of LOAD_FORMATS
    blobs: tuple[str, ...] = ()  # stage: Redis keys of one safetensors buffer's parts, in order
    version: str | None = None  # commit: the new weight version (None: keep it)
    flush_cache: bool = True  # commit: empty the prefix cache (KV computed by the old weights)
    broadcast: Broadcast | None = None  # stage: receive these tensors in a collective group


class LoadAdapter(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """/v1/load_lora_adapter, /load_lora_adapter (a PEFT directory at `path`, on the workers' disk) and
    /load_lora_adapter_from_tensors (safetensors bytes in Redis, `blobs`: one buffer's parts each, with
    the LoRA config given beside them) on one replica. The scheduler picks the device slot (a free
    one: never one a running request reads, so no step sees half an adapter) and relays the message
    with it to its worker, which reads, checks and writes the slot between steps. Once the worker
    answers, the name maps to that slot under a new generation (a prefix cached under the old one is
    never reused), and `version`, if given, becomes the replica's weight version."""

    rid: str
    gateway: str
    name: str
    path: str = ""  # a PEFT directory; "" when the tensors come in `blobs`
    blobs: tuple[tuple[str, ...], ...] = ()  # Redis keys of safetensors buffers' parts, a tuple per buffer
    rank: int = 0  # with blobs: PEFT's r, lora_alpha, target_modules (PEFT's module names), use_rslora
    alpha: float = 0.0
    target_modules: tuple[str, ...] = ()
    use_rslora: bool = False
    version: str | None = None  # the weight version once loaded (None: kept)
    slot: int = -1  # set by the scheduler for its worker


class UnloadAdapter(msgspec.Struct, frozen=True, tag=True):
    """/v1/unload_lora_adapter, /unload_lora_adapter on one replica's scheduler: the name is refused to
    new requests at once; its slot is freed when the requests running under it end."""

    rid: str
    gateway: str
    name: str


MEMORY_TAGS = ("weights", "kv_cache")


class Memory(msgspec.Struct, frozen=True, tag=True):
    """/release_memory_occupation, /resume_memory_occupation on one replica: free or reallocate the
    worker's device buffers (same shapes and shardings; nothing recompiles). The KV cache comes back
    empty, the weights without their values: the next update brings them (worker_svc/control.py)."""

    rid: str
    gateway: str
    release: bool  # False: resume
    tags: tuple[str, ...] = MEMORY_TAGS


class WeightGroup(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """/init_weights_update_group (`join`) and /destroy_weights_update_group on one replica, relayed
    to its worker: it joins the trainer's torch.distributed group `group` (rendezvous at
    master_address:master_port, the trainer's rank 0) as rank `rank_offset + replica`, one rank per
    replica (a replica of several devices is one process: one rank), and answers once every rank of
    `world_size` has joined; or it leaves the group. `backend` "": NCCL where the worker's devices
    are GPUs, else gloo."""

    rid: str
    gateway: str
    group: str
    join: bool  # False: leave (destroy) the group
    master_address: str = ""
    master_port: int = 0
    rank_offset: int = 1  # this replica's rank is rank_offset + its replica number
    world_size: int = 0
    backend: str = ""  # one of GROUP_BACKENDS, or "": the worker's devices choose


class ControlReply(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """A replica's answer to a control message: done, or why not."""

    rid: str
    ok: bool
    message: str = ""
    replica: int = 0
    weight_version: str = ""  # the replica's, after the message
    model_path: str = ""  # where its weights last came from (a checkpoint), after the message
    # pause: the requests it aborted, retracted or froze; commit: the requests that waited for it
    requests: int = 0
