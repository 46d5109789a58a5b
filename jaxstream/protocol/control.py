"""Control: the gateway asks every replica's scheduler; a scheduler relays what concerns the device
(UpdateWeights, Memory) to its worker in step order, and every answer is a ControlReply (a
FlushCacheReply for a flush) to the asking gateway: a worker's goes through its scheduler, which
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


class UpdateWeights(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """One phase of a weight update on one replica, relayed by the scheduler to its worker.

    `stage` loads new weights beside the live ones (from `path`, or the safetensors bytes in
    `blobs`, several stages adding up), checked, while the old weights keep serving; `commit`
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


MEMORY_TAGS = ("weights", "kv_cache")


class Memory(msgspec.Struct, frozen=True, tag=True):
    """/release_memory_occupation, /resume_memory_occupation on one replica: free or reallocate the
    worker's device buffers (same shapes and shardings; nothing recompiles). The KV cache comes back
    empty, the weights without their values: the next update brings them (worker_svc/control.py)."""

    rid: str
    gateway: str
    release: bool  # False: resume
    tags: tuple[str, ...] = MEMORY_TAGS


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
