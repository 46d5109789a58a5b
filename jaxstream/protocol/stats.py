"""What each service instance publishes beside its heartbeat: its stats, with the facts only it
knows. The gateway reads them for /stats, /metrics, /v1/loads, /get_model_info, /get_server_info
and for the checks of a request (its length, routed experts).

One Struct per role and the union `Stats`: jaxstream.transport writes an instance's with each
heartbeat (expiring with it) and reads them back with one typed decoder, so a reader gets ints,
floats and bools. A field a service does not report (the fake worker's model has no layer count;
the idle gaps before the first step) is UNSET, never a made-up value: it is absent from the
message and from /stats, where a nested Struct's fields (facts) show at the top level.
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType


class ModelFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What the worker knows of the model it serves: what a request for routed experts needs
    (gateway/experts.py), and the checkpoint's names (/get_model_info)."""

    moe_layers: int  # layers with experts; 0: a dense model
    enable_return_routed_experts: bool  # worker.enable_return_routed_experts, as this worker runs
    num_hidden_layers: int | UnsetType = UNSET
    num_experts_per_tok: int | UnsetType = UNSET
    architectures: str | UnsetType = UNSET  # the checkpoint config's, comma-separated
    model_type: str | UnsetType = UNSET


class WorkerStats(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    facts: ModelFacts
    steps: int  # run since start-up
    weight_version: str
    model_path: str  # where the live weights last came from whole ("dummy": random)
    released: str  # the device memory released now: MEMORY_TAGS, comma-separated; "" none
    rss_bytes: int  # the process's resident memory; 0 where /proc is not
    step_ms: float | UnsetType = UNSET  # the last step's time (the JAX worker's)
    compiled_shapes: int | UnsetType = UNSET
    compiles_after_ready: int | UnsetType = UNSET  # step shapes compiled after start-up: any is a bug
    device_bytes_in_use: int | UnsetType = UNSET  # where the platform reports it (GPU, TPU; not XLA:CPU)
    # The constraint masks' computation per step, once a constrained row ran
    constraint_mask_ms_p50: float | UnsetType = UNSET
    constraint_mask_ms_p99: float | UnsetType = UNSET
    # The idle gaps between decode steps (worker_svc/idle.py): how many, and the window's percentiles
    idle_gaps: int | UnsetType = UNSET
    idle_gap_ms_p50: float | UnsetType = UNSET
    idle_gap_ms_p90: float | UnsetType = UNSET
    idle_gap_ms_p99: float | UnsetType = UNSET
    # The KV cache's bytes per token slot, from the arrays the worker allocated (the JAX worker's):
    # what scheduler.kv_cache_memory_gib sizes the pool by (jaxstream/kv_memory.py says it alike)
    kv_bytes_per_token: int | UnsetType = UNSET


class SchedulerStats(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Gauges, limits, and the counters and histograms only a scheduler can keep (cumulative since
    it started), for /metrics (gateway/scheduler_metrics.py), /v1/loads and /stats. A histogram is
    two fields (jaxstream/histogram.py): `<name>_buckets`, the cumulative count of each bound and
    a last one for +Inf, which is the count; `<name>_sum`."""

    running: int
    waiting: int
    waiting_deferred: int  # of them, held back by a pause, new weights or memory awaited (vLLM's "deferred")
    pages_used: int  # the prefix cache's included
    pages_free: int
    pages_total: int
    pages_cached: int  # held by the prefix cache
    pages_evictable: int  # of those, pinned by no request: free for the taking
    page_size: int
    prefix_cache: int  # 1: on
    max_running_requests: int
    max_total_tokens: int
    requests_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    aborted_total: int
    preempted_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    spec_decode_num_drafts_total: int
    spec_decode_num_draft_tokens_total: int
    spec_decode_num_accepted_tokens_total: int
    spec_decode_acceptance_rate: float
    request_queue_time_seconds_buckets: tuple[int, ...]
    request_queue_time_seconds_sum: float
    request_prefill_time_seconds_buckets: tuple[int, ...]
    request_prefill_time_seconds_sum: float
    request_decode_time_seconds_buckets: tuple[int, ...]
    request_decode_time_seconds_sum: float
    request_inference_time_seconds_buckets: tuple[int, ...]
    request_inference_time_seconds_sum: float
    iteration_tokens_total_buckets: tuple[int, ...]
    iteration_tokens_total_sum: float
    max_queued_requests: int | UnsetType = UNSET  # scheduler.max_queued_requests, when set
    # Liveness: the wall-clock time (time.time(), the scheduler's) since which it has had steps in
    # flight and absorbed no result; unset while none is in flight. Written with the heartbeat, so
    # a wedged loop's stays where it stopped: past server.scheduler_stall_s it is stalled
    # (jaxstream/transport/liveness.py).
    awaiting_results_since: float | UnsetType = UNSET
    # A hybrid's (linear attention's) recurrent-state pool: a row per request slot, held by the running
    # request in it (scheduler_svc/core.py); unset for a model without linear layers
    state_slots_total: int | UnsetType = UNSET
    state_slots_used: int | UnsetType = UNSET
    state_slots_free: int | UnsetType = UNSET
    # A hybrid model's state snapshots (scheduler.state_snapshots; scheduler_svc/snapshots.py): the
    # rows kept, and those holding a prefix's state or a save in flight. Unset for other models, or
    # with the prefix cache off.
    state_snapshots_total: int | UnsetType = UNSET
    state_snapshots_used: int | UnsetType = UNSET


class TokenizerFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What the gateway needs to know of the model and only the tokenizer knows."""

    max_model_len: int  # the context: prompt and output tokens
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    has_chat_template: bool


class TokenizerStats(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    facts: TokenizerFacts
    processed: int  # messages handled
    reclaimed: int  # of them, taken over from a tokenizer that died


class DetokenizerStats(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    requests: int  # held now
    started: int  # since start-up


Stats = WorkerStats | SchedulerStats | TokenizerStats | DetokenizerStats
