"""The scheduler group: admission, batching, the KV page pool, the prefix cache and speculation."""

from __future__ import annotations

from dataclasses import dataclass

from jaxstream.config.errors import require

SCHEDULING_POLICIES = ("fcfs", "lpm")
SPECULATIVE_METHODS = ("none", "ngram")
DEFAULT_NUM_PAGES = 1024  # scheduler.num_pages when neither it nor kv_cache_memory_gib is set


@dataclass
class SchedulerConfig:
    """What runs each step: admission, batching, the KV page pool and the prefix cache."""

    policy: str = "fcfs"
    """Admission order: "fcfs", arrival order; "lpm", the longest cached prefix first.

    "lpm" (longest prefix match, as SGLang's) takes the waiting request with the longest prefix in
    the prefix cache first (among the first 128 waiting; a head overtaken 128 times goes next).
    Without the prefix cache lpm is fcfs."""
    prefix_cache: bool = True
    """The radix prefix cache: requests read the KV pages of a prefix computed before instead of recomputing it.

    The prefix may be prompt and output; it is reported as `cached_tokens`. Unused pages stay cached
    until pages run short (least recently used first) or /flush_cache. false: every request
    computes its whole prompt, and every page is free at idle."""
    overlap: bool = True
    """Plan and publish step N + 1 as soon as step N is published, before its result; false: one step in flight.

    A decode then follows the token in flight, which the worker reads on the device. The worker goes
    from one step to the next without waiting for the scheduler; a request that stops computes one
    token for nothing. false: plan after each result."""
    max_running_requests: int = 64
    """Requests running at once: the most a step decodes."""
    max_tokens_per_step: int = 512
    """The per-step token budget (prefill chunks + decodes).

    A step's own tokens attend each other densely (T x T), so on CPU a smaller budget serves many
    concurrent streams faster than a large one (measured in docs/performance.md)."""
    page_size: int = 16
    """Tokens per KV page."""
    num_pages: int | None = None
    """KV pool size, in pages (the worker allocates it, and logs its size in MB at start-up); null: 1024, or kv_cache_memory_gib's.

    Set it or scheduler.kv_cache_memory_gib, not both."""
    kv_cache_memory_gib: float | None = None
    """KV pool size as memory, in GiB (2**30 bytes): num_pages = floor(it / (page_size x the model's KV bytes per token)).

    vLLM's --kv-cache-memory-bytes says it in bytes, per device. The bytes per token are the model's (jaxstream/kv_memory.py:
    layers x 2 x KV heads x head_dim, or for multi-head latent attention layers x (kv_lora_rank +
    qk_rope_head_dim), times the bytes of worker.kv_cache_dtype's storage), from model.hf_config or
    model.path's config, so the scheduler and the worker size the same pool; the worker reports the
    figure (kv_bytes_per_token in /stats and /get_server_info). It is the whole replica's cache: a
    mesh that splits the KV heads holds a share of it on each device. null: scheduler.num_pages."""
    max_queued_requests: int = 4096
    """Requests waiting for a running slot (retracted ones included) beyond which a new one gets a 503.

    The 503 carries Retry-After. 4096 takes a whole RL rollout batch at once (e.g. 256 prompts x 16
    samples) while bounding the scheduler's memory (every queued prompt's tokens are held in Python)
    and the wait: 64 rounds of a full 64-request batch, which outlasts usual client timeouts for
    long generations anyway."""

    state_snapshots: int = 64
    """A hybrid model's prefix cache (linear-attention layers: Qwen3.5, Qwen3-Next): how many states it keeps.

    A hit needs the linear layers' state at the prefix's end, not only its KV pages, so the worker
    keeps this many state rows beside the running requests' own (as SGLang's hybrid radix cache keeps
    a state per node): a prompt's prefill stops at its last page boundary and saves its state there
    (vLLM's "align" mode), and a hit ends at the deepest cached prefix whose state is kept (least
    recently used first when none is free). Each costs one running request's state (every linear
    layer's convolution window and recurrent matrix, float32), counted in kv_cache_memory_gib. The
    default is max_running_requests' default: a full batch can each leave its prompt's state for a
    next turn, at most doubling the state memory. 0: no prefix cache for a hybrid (every prompt is
    computed whole). Not read for other models, nor with prefix_cache false."""

    speculative: str = "none"
    """Speculative decoding: "none", or "ngram" (prompt lookup, as vLLM's): drafts from the request's own tokens.

    A decoding request whose last tokens (prompt_lookup_max down to prompt_lookup_min of them)
    occurred before in its prompt or output is given the tokens that followed them there as a
    draft; the worker verifies the draft in one step (a sampled token is kept while it equals the
    draft's, so outputs are those of decoding without it, greedy or sampled with the same seed).
    A request that drafts skips overlap for that step. Not for constrained requests, nor below
    min_tokens; at most max_running_requests tokens are sampled per step."""
    num_speculative_tokens: int = 4
    """Most draft tokens a request verifies per step (speculative=ngram)."""
    prompt_lookup_max: int = 4
    """Longest suffix of a request's tokens looked up for a draft (speculative=ngram); tried first."""
    prompt_lookup_min: int = 2
    """Shortest suffix of a request's tokens looked up for a draft (speculative=ngram)."""

    def __post_init__(self) -> None:
        require(
            self.speculative in SPECULATIVE_METHODS,
            "scheduler.speculative",
            f"must be one of {SPECULATIVE_METHODS}, got {self.speculative!r}",
        )
        for key in ("num_speculative_tokens", "prompt_lookup_min"):
            value = getattr(self, key)
            require(value >= 1, f"scheduler.{key}", f"must be >= 1, got {value}")
        require(
            self.prompt_lookup_max >= self.prompt_lookup_min,
            "scheduler.prompt_lookup_max",
            f"({self.prompt_lookup_max}) must be >= scheduler.prompt_lookup_min ({self.prompt_lookup_min})",
        )
        require(
            self.policy in SCHEDULING_POLICIES,
            "scheduler.policy",
            f"must be one of {SCHEDULING_POLICIES}, got {self.policy!r}",
        )
        require(self.state_snapshots >= 0, "scheduler.state_snapshots", f"must be >= 0, got {self.state_snapshots}")
        for key in ("max_running_requests", "max_tokens_per_step", "page_size", "max_queued_requests"):
            value = getattr(self, key)
            require(value >= 1, f"scheduler.{key}", f"must be >= 1, got {value}")
        memory = self.kv_cache_memory_gib
        require(self.num_pages is None or memory is None, "scheduler.num_pages",
                f"({self.num_pages}) and scheduler.kv_cache_memory_gib ({memory}) both size the KV pool: set one of them")
        require(memory is None or memory > 0, "scheduler.kv_cache_memory_gib", f"must be > 0 (GiB), got {memory}")
        require(self.num_pages is None or self.num_pages >= 1, "scheduler.num_pages", f"must be >= 1, got {self.num_pages}")
        if self.num_pages is None and memory is None:
            self.num_pages = DEFAULT_NUM_PAGES
        # With kv_cache_memory_gib, num_pages stays null here: only the model's numbers size it, which
        # jaxstream/preflight.py reads (jaxstream/kv_memory.py), in every process, before it serves.
        require(
            self.max_tokens_per_step >= self.max_running_requests,
            "scheduler.max_tokens_per_step",
            f"({self.max_tokens_per_step}) must be >= scheduler.max_running_requests "
            f"({self.max_running_requests}) so every running request can decode each step",
        )
