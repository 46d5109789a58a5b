"""Start-up of the JAX worker: compilation cache, weights, KV cache, and every compiled step shape.
Each phase logs one line with its time, and tells `phase` (the worker's Bus) where it is.

Here, and only here, the kernels are built and injected: `numerics` hands the model a `CpuKernels`
(cpu_kernels/: our own, on XLA:CPU) or a `PallasKernels` (pallas_kernels/: JAX's, on a GPU or
interpreted) in its Numerics, as worker.attention_backend chooses (attention_backend.py), which the
layers and the engine reach them through."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from jaxstream.config import AppConfig, ConfigError
from jaxstream.kv_memory import page_pool, state_snapshots
from jaxstream.model_files import load_tokenizer
from worker_svc import attention_backend
from worker_svc.batch import MIN_TOKENS, Buckets
from worker_svc.constrained import Constraints
from worker_svc.cpu_kernels import attention_kernel, product_kernel
from worker_svc.cpu_kernels.kernels import CpuKernels
from worker_svc.engine import Engine
from worker_svc.layers.numerics import Numerics
from worker_svc.loading import load_model, open_model
from worker_svc.pallas_kernels.kernels import PallasKernels
from worker_svc.progress import bar
from worker_svc.sharding import ask_for_cpu_devices, make_layout
from worker_svc.weights import CheckpointError

log = logging.getLogger(__name__)


def default_buckets(cfg: AppConfig, max_model_len: int) -> Buckets:
    s, w = cfg.scheduler, cfg.worker
    tokens = w.token_buckets or _powers_of_two(s.max_tokens_per_step)
    pages_per_request = -(-max_model_len // s.page_size)
    pairs = w.pair_buckets or _pair_buckets(max(pages_per_request, s.num_pages))
    if pairs[-1] < pages_per_request:  # one decode token at full context must fit a step
        raise ConfigError(f"worker.pair_buckets: the largest ({pairs[-1]}) must hold a whole context of "
                          f"{pages_per_request} pages (model.max_model_len {max_model_len} / scheduler.page_size {s.page_size})")
    return Buckets(tuple(tokens), tuple(pairs), s.max_running_requests, pages_per_request, w.page_list_tokens)


def numerics(cfg: AppConfig, devices: int = 1, hf_config: dict[str, Any] | None = None) -> Numerics:
    """The model's Numerics from the config, for a replica of `devices` devices serving a model of
    `hf_config` (None: not checked), with the kernels worker.attention_backend chooses
    (attention_backend.py) and worker.product_kernel asks for: the CPU kernels (cpu_kernels/) where
    their conditions hold (their config docstrings: the CPU platform, one device, no
    batch_invariant) and they build, or JAX's Pallas kernels (pallas_kernels/: attention on a GPU
    or interpreted, MoE's grouped matmul on one TPU); None when neither.
    A ConfigError naming worker.attention_backend for a backend the platform cannot run."""
    w = cfg.worker
    platform = jax.default_backend()
    backend, why = attention_backend.choose(w, platform, devices, hf_config)
    if why:
        log.info("%s", why)
    if backend == "pallas" and not w.batch_invariant:
        interpret = platform == "cpu"
        log.info("attention: JAX's Pallas kernels%s", " in interpret mode (slow: a check, not a speed)" if interpret else "")
        return Numerics(router_fp32=w.router_fp32, lm_head_fp32=w.lm_head_fp32, quantization=w.quantization,
                        kernels=PallasKernels(interpret=interpret))
    if platform == "tpu" and devices == 1 and not w.batch_invariant:  # MoE's grouped matmul by megablox (moe=ep)
        return Numerics(router_fp32=w.router_fp32, lm_head_fp32=w.lm_head_fp32, quantization=w.quantization,
                        kernels=PallasKernels(attention=False, grouped=True))
    on_cpu = not w.batch_invariant and devices == 1 and platform == "cpu"
    products = _kernel(w.product_kernel and on_cpu, product_kernel, "worker.product_kernel",
                       "the product kernel", "weight products run in XLA")
    attention = _kernel(backend == "cpu_kernel" and on_cpu, attention_kernel, "worker.attention_kernel",
                        "the attention kernel", "decode attention runs in XLA")
    return Numerics(batch_invariant=w.batch_invariant, router_fp32=w.router_fp32, lm_head_fp32=w.lm_head_fp32,
                    quantization=w.quantization,
                    kernels=CpuKernels(products=products, attention=attention) if products or attention else None)


def _kernel(wanted: bool, module, key: str, name: str, instead: str) -> bool:
    """Whether a wanted CPU kernel (`module`'s `load`) is ready: if it cannot build, a warning says why."""
    if not wanted:
        return False
    started = time.perf_counter()
    why = module.load()
    if why:
        log.warning("%s: %s is not available (%s); %s", key, name, why, instead)
        return False
    log.info("%s ready in %.1f s", name, time.perf_counter() - started)
    return True


def _powers_of_two(limit: int) -> list[int]:
    sizes = [MIN_TOKENS]
    while sizes[-1] < limit:
        sizes.append(sizes[-1] * 2)
    return sizes


def _pair_buckets(limit: int) -> list[int]:
    sizes = [0, 16]
    while sizes[-1] < limit:
        sizes.append(sizes[-1] * 4)
    return sizes


def no_libtpu(record: logging.LogRecord) -> bool:
    """JAX probes for a TPU on every start and logs (at INFO) that libtpu.so is absent: on a machine
    without libtpu there is no TPU to miss. Any other backend failure still shows."""
    message = record.getMessage()
    return not (message.startswith("Unable to initialize backend 'tpu'") and "cannot open shared object file" in message)


def build_engine(cfg: AppConfig, progress: bool = True, phase: Callable[[str], None] = lambda text: None,
                 started: float | None = None) -> Engine:
    """`phase`: told what start-up is doing ("loading weights 10/272"), as often as progress is drawn.
    `started`: time.perf_counter() before the caller imported this module (JAX), for the first phase's time."""

    def report(label: str, done: int, total: int, seconds: float) -> None:
        phase(f"{label} {done}/{total}")
        if progress:
            bar(label, done, total, seconds)

    logging.getLogger("jax._src.xla_bridge").addFilter(no_libtpu)  # once: the same function
    phase("starting JAX")
    started = time.perf_counter() if started is None else started
    if cfg.worker.compile_cache_dir:
        cache_dir = Path(cfg.worker.compile_cache_dir).expanduser()
        cache_dir.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(cache_dir))
        # Cache every step shape, however quick it was to compile: there are dozens of them.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    ask_for_cpu_devices(cfg.parallelism)  # before JAX's first use of a device
    layout = make_layout(cfg.parallelism)  # before loading: a wrong device count fails at once
    log.info("JAX: %d %s device(s) in %.1f s", layout.mesh.size, jax.devices()[0].platform, time.perf_counter() - started)
    # Random weights when asked, or when there is no file to read them from (model.hf_config alone).
    dummy = cfg.worker.weights == "dummy" or cfg.model.path is None
    if cfg.model.path is None:
        log.warning("model.path is null: %s runs with random weights (from model.hf_config's numbers)", cfg.model.name)
    phase("loading weights")
    started = time.perf_counter()
    try:
        checkpoint = open_model(cfg.model, dummy)
        model = load_model(checkpoint, cfg.worker.dtype, dummy=dummy, seed=cfg.worker.seed, progress=report,
                           moe=cfg.moe.strategy, layout=layout if layout.mesh.size > 1 else None,
                           numerics=numerics(cfg, layout.mesh.size, checkpoint.config))
    except CheckpointError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith("model.") else f"model.path: {message}") from None
    log.info("weights loaded in %.1f s%s", time.perf_counter() - started, " (dummy)" if dummy else "")
    # The pool scheduler.kv_cache_memory_gib holds, from the numbers the model was built from: the
    # scheduler sized it from the same ones (jaxstream/preflight.py), by the same rule.
    cfg.scheduler.num_pages = page_pool(cfg, lambda: (str(checkpoint.path), checkpoint.config))
    max_model_len = cfg.model.max_model_len or checkpoint.config.get("max_position_embeddings")
    if not max_model_len:
        raise ConfigError(f"model.max_model_len: {checkpoint.path}'s config states no max_position_embeddings; set one of them")
    pool = cfg.scheduler.num_pages * cfg.scheduler.page_size
    if max_model_len > pool:
        log.warning("the context (%d tokens) exceeds the KV pool (%d: scheduler.num_pages x page_size): a request "
                    "outgrowing the pool ends with finish_reason length; set model.max_model_len or raise "
                    "scheduler.num_pages", max_model_len, pool)
    buckets = default_buckets(cfg, max_model_len)
    salt = random.SystemRandom().getrandbits(32)  # requests without a seed differ run to run
    phase("loading the tokenizer")  # constrained requests' matchers read it
    started = time.perf_counter()
    tokenizer = load_tokenizer(cfg.model)
    constraints = Constraints.for_tokenizer(tokenizer.tokenizer, model.cfg.vocab, tokenizer.eos_token_ids)
    log.info("tokenizer read for constrained decoding in %.1f s", time.perf_counter() - started)
    facts = {"architectures": ",".join(checkpoint.config.get("architectures", [])), "model_type": checkpoint.config.get("model_type", "")}
    # One device: no layout at all, so the single-device path stays the one measured and tested
    # (the HLO no-copy check) rather than a one-device mesh.
    engine = Engine(model, buckets, cfg.scheduler.page_size, cfg.scheduler.num_pages, salt, facts,
                    layout if layout.mesh.size > 1 else None, routed_experts=cfg.worker.enable_return_routed_experts,
                    constraints=constraints, kv_cache_dtype=cfg.worker.kv_cache_dtype, huge_pages=cfg.worker.huge_pages,
                    max_logprobs=cfg.server.max_logprobs, lora=cfg.worker.lora, state_snapshots=state_snapshots(cfg))
    pages = engine.weight_pages
    if pages.asked:
        (log.warning if pages.why else log.info)("weights on 2 MB pages: %.0f of %.0f MB (worker.huge_pages)%s", pages.granted / 1e6,
                                                 pages.asked / 1e6, f"; the rest on 4 KB pages: {pages.why}" if pages.why else "")
    per_token, s = engine.kv_bytes_per_token, cfg.scheduler
    log.info("KV cache: %d pages of %d tokens, %.0f MB, %d bytes a token (worker.kv_cache_dtype=%s%s)", s.num_pages, s.page_size,
             per_token * s.num_pages * s.page_size / 1e6, per_token, cfg.worker.kv_cache_dtype,
             "" if s.kv_cache_memory_gib is None else f"; the pages scheduler.kv_cache_memory_gib={s.kv_cache_memory_gib:g} holds")
    if engine.cache_spec.states:  # a hybrid's linear layers: a state per request slot and per kept snapshot, beside the pages
        per_slot, rows = engine.cache_spec.state_bytes_per_slot(), engine.buckets.max_rows + engine.state_snapshots
        log.info("recurrent states: %d slots and %d prefix cache snapshots of %d bytes each, %.1f MB "
                 "(scheduler.max_running_requests, scheduler.state_snapshots)", engine.buckets.max_rows, engine.state_snapshots,
                 per_slot, rows * per_slot / 1e6)
    if cfg.worker.enable_return_routed_experts and engine.experts is None:
        log.warning("worker.enable_return_routed_experts: %s has no MoE layer; requests asking for routed experts get a 400",
                    cfg.model.name)
    phase("compiling step shapes")
    seconds = engine.executables.compile_all(progress=report)
    log.info("%d step shapes ready in %.1f s (%s, mesh %s)", engine.compiled, seconds, jax.devices()[0].platform,
             dict(layout.mesh.shape))
    return engine
