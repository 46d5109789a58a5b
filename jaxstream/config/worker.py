"""The worker group: which engine runs the steps, its weights, dtype, compiled shapes and CPU kernels."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxstream.accelerator import auto_dtype
from jaxstream.config.errors import require

WORKER_KINDS = ("jax", "fake")
WEIGHTS = ("file", "dummy")
DTYPES = ("float32", "bfloat16")  # what a model runs in; the config also takes "auto" (resolved to one)
QUANTIZATIONS = ("int8",)  # besides null
KV_CACHE_DTYPES = ("auto", "bfloat16")
ATTENTION_BACKENDS = ("auto", "native", "cpu_kernel", "pallas")


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # attention's and the dense MLP's projections


@dataclass
class LoraConfig:
    """Adapter slots beside the base weights (worker_svc/layers/lora.py); off by default: nothing of them compiled."""

    max_adapters: int = 0
    """Adapter slots, each any adapter of rank up to max_rank; 0: none (the step is the base model's alone)."""
    max_rank: int = 16
    """The slots' rank: an adapter of a lower rank is zero-padded to it, a higher one refused."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """The projections the slots adapt (q, k, v, o, gate, up, down); an adapter targeting another is refused. Experts: never."""
    adapters: dict[str, str] = field(default_factory=dict)
    """Adapters loaded at start, name -> PEFT directory on the worker's disk; requests name them as models.
    They take slots 0, 1, ... in name order (`start_slots`); more can be loaded at run time (/v1/load_lora_adapter)."""

    def start_slots(self) -> dict[str, int]:
        """The slot of each adapter loaded at start: in name order from 0, where the worker loads them
        and the scheduler's registry places them."""
        return {name: slot for slot, name in enumerate(sorted(self.adapters))}

    def __post_init__(self) -> None:
        require(self.max_adapters >= 0, "worker.lora.max_adapters", f"must be >= 0, got {self.max_adapters}")
        require(self.max_rank >= 1, "worker.lora.max_rank", f"must be >= 1, got {self.max_rank}")
        unknown = [m for m in self.target_modules if m not in LORA_TARGETS]
        require(bool(self.target_modules) and not unknown, "worker.lora.target_modules",
                f"must name some of {list(LORA_TARGETS)}, got {list(self.target_modules)}")
        require(len(self.adapters) <= self.max_adapters, "worker.lora.adapters",
                f"names {len(self.adapters)} adapters, more than worker.lora.max_adapters ({self.max_adapters}) slots")
        for name, path in self.adapters.items():
            require(bool(name) and bool(path) and isinstance(path, str), f"worker.lora.adapters.{name}",
                    f"must map a name to a PEFT directory, got {path!r}")


@dataclass
class WorkerConfig:
    """The device side: which engine runs the steps, its weights, dtype and compiled shapes."""

    kind: str = "jax"
    """The engine: "jax", the model; "fake", the deterministic stand-in of worker_svc/fake.py, for pipeline tests."""
    weights: str = "file"
    """Where parameters come from: "file", model.path's tensors; "dummy", random, same architecture."""
    dtype: str = "auto"
    """Parameters and KV cache: auto, float32 or bfloat16; auto is bfloat16 on a GPU or TPU, float32 on a CPU.

    auto is resolved as the config loads (jaxstream/accelerator.py: JAX_PLATFORMS, else JAX's GPU or
    TPU plugin installed), so every service sizes the KV cache alike without importing JAX; where
    a plugin is installed without its device, or services run on different machines, name the
    dtype. On CPU bfloat16 is slower than float32 (measured in docs/performance.md)."""
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
    softmax state per 128 pairs, so a long prompt's first token comes sooner by page lists: measured
    in docs/performance.md), else 64."""
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
    measured in docs/performance.md."""
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
    weight memory, and faster decode where reading the weights bounds it (measured in
    docs/performance.md). Costs: each weight within half its channel's scale of the original, so
    logits move slightly and a greedy answer may flip a token (benchmarks/quantization.py measures
    it on SmolLM2); a GGUF's own quantized blocks are dequantized and requantized per channel."""

    product_kernel: bool = True
    """On CPU, weight products of few rows (decode, short verify steps) by jaxstream's own kernel.

    Float32 weights and int8 ones (worker.quantization=int8), steps of up to 32 rows (by a tied LM
    head's table, 8). Only on the CPU platform, without a device mesh and without batch_invariant;
    elsewhere XLA's products. The kernel (worker_svc/cpu_kernels/product_kernel.cc) reads each layer's
    weight once, where it lies in the layer stack, and converts int8 values in registers; XLA:CPU
    slices each layer's weight out into a copy first, and converts int8 weights to a float32 copy
    (measured in docs/performance.md). It is compiled at start-up with the machine's C++ compiler,
    once (kept in $XDG_CACHE_HOME, else ~/.cache, under jaxstream/kernels); without one the worker
    logs a warning and uses XLA's products. Sums are float32 in another order, so logprobs move by
    float32 rounding against false."""
    attention_kernel: bool = True
    """On CPU, attention over the KV cache and over a step's own keys by jaxstream's own kernel.

    Steps that read page lists (worker.page_list_tokens: by default every step where the kernel
    applies) read each row's cached keys and values; the kernel
    (worker_svc/cpu_kernels/attention_kernel.cc) reads them in place, once, where XLA gathers, multiplies
    and sums in separate passes. It also attends each token to its own row's keys in the step alone,
    where XLA's tiles score whole tiles and mask (measured in docs/performance.md). Only on the CPU
    platform, without a device mesh and without batch_invariant; float32 activations over a float32
    or bfloat16 cache, head dimension 64 or 128, 1, 2, 3, 4 or 8 query heads per key head; elsewhere
    XLA's attention. It is compiled at start-up with the machine's C++ compiler, once (kept in
    ~/.cache/jaxstream/kernels); without one the worker logs a warning and uses XLA's. Sums are
    float32 in another order, so logprobs move by float32 rounding against false. False: the
    cpu_kernel attention backend is off, and worker.attention_backend=auto is native on CPU."""
    attention_backend: str = "auto"
    """How attention reads the KV cache and a step's own keys: auto, native, cpu_kernel or pallas.

    "native": jax.numpy, on every platform. "cpu_kernel": jaxstream's C++ kernel (worker.attention_kernel's
    conditions), the CPU platform only. "pallas": JAX's own Pallas kernels (jax.experimental.pallas.ops:
    paged attention over the cache, flash attention over a step's own keys) on one GPU; on a CPU in
    Pallas' interpret mode (exact, slow: a check without a GPU); a model with sliding windows or
    latent attention runs native, logged. "auto": cpu_kernel on a CPU, pallas on one GPU, native on a
    TPU or a mesh (worker_svc/attention_backend.py). A backend the platform cannot run (cpu_kernel
    off the CPU, pallas on a TPU or over several devices) is refused at start."""
    kv_cache_dtype: str = "auto"
    """What the KV cache holds: "auto", worker.dtype; "bfloat16", keys and values rounded to bfloat16 (half float32's bytes).

    As vLLM's and SGLang's --kv-cache-dtype. Under float32 weights, "bfloat16" halves the cache's
    memory and the bytes decode attention reads per step, which bounds it at long contexts on CPU
    (measured in docs/performance.md, with what it does to the answers); arithmetic stays float32. A
    step attends its own keys and values rounded as the cache will hold them, so a key counts the
    same from a prefix-cache hit or chunked prefill, and batch_invariant still holds across batches
    (a trainer matching the served logprobs to the bit, as examples/grpo's, computes with "auto"'s
    unrounded keys). Under bfloat16 weights it is the same as "auto"."""

    huge_pages: bool = True
    """On Linux, the weights' CPU buffers asked onto 2 MB (transparent huge) pages, at start-up and after each weight update.

    Decode at a small batch is its weight reads, and on 4 KB pages each page of a weight is an
    address translation the CPU looks up as it reads; on 2 MB pages it looks up fewer, and decode
    steps run faster (measured in docs/performance.md). Asked by madvise (MADV_HUGEPAGE, then
    MADV_COLLAPSE: Linux 6.1+), a hint that changes no value: where the kernel declines (older,
    transparent huge pages "never", memory too fragmented), the worker logs why and serves from 4 KB
    pages. No effect on a GPU or TPU's memory (worker_svc/huge_pages.py)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapter slots (worker.lora.*): off by default."""

    def __post_init__(self) -> None:
        require(self.kind in WORKER_KINDS, "worker.kind", f"must be one of {WORKER_KINDS}, got {self.kind!r}")
        require(self.weights in WEIGHTS, "worker.weights", f"must be one of {WEIGHTS}, got {self.weights!r}")
        require(self.dtype in ("auto", *DTYPES), "worker.dtype", f"must be one of {('auto', *DTYPES)}, got {self.dtype!r}")
        if self.dtype == "auto":
            self.dtype = auto_dtype()
        for key in ("token_buckets", "pair_buckets"):
            buckets = getattr(self, key)
            if buckets is not None:
                require(bool(buckets) and list(buckets) == sorted(set(buckets)), f"worker.{key}",
                        f"must be a non-empty ascending list without repeats, got {list(buckets)}")
                least = 1 if key == "token_buckets" else 0
                require(buckets[0] >= least, f"worker.{key}", f"must hold sizes >= {least}, got {list(buckets)}")
        require(self.step_delay_ms >= 0, "worker.step_delay_ms", f"must be >= 0, got {self.step_delay_ms}")
        require(self.page_list_tokens is None or self.page_list_tokens >= 0, "worker.page_list_tokens",
                f"must be null or >= 0, got {self.page_list_tokens}")
        require(self.quantization is None or self.quantization in QUANTIZATIONS, "worker.quantization",
                f"must be null or one of {QUANTIZATIONS}, got {self.quantization!r}")
        require(self.attention_backend in ATTENTION_BACKENDS, "worker.attention_backend",
                f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        require(self.kv_cache_dtype in KV_CACHE_DTYPES, "worker.kv_cache_dtype",
                f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
