"""Start-up of the JAX worker: compilation cache, weights, KV cache, and every compiled step shape."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import jax

from jaxstream.config import AppConfig, ConfigError
from worker_svc.batch import MIN_TOKENS, Buckets
from worker_svc.engine import Engine
from worker_svc.loading import load_model
from worker_svc.sharding import make_layout
from worker_svc.weights import CheckpointError, open_checkpoint

log = logging.getLogger(__name__)


def default_buckets(cfg: AppConfig, max_model_len: int) -> Buckets:
    s, w = cfg.scheduler, cfg.worker
    tokens = w.token_buckets or _powers_of_two(s.max_tokens_per_step)
    pages_per_request = -(-max_model_len // s.page_size)
    pairs = w.pair_buckets or _pair_buckets(max(pages_per_request, s.num_pages))
    if pairs[-1] < pages_per_request:  # one decode token at full context must fit a step
        raise ConfigError(f"worker.pair_buckets: the largest ({pairs[-1]}) must hold a whole context of "
                          f"{pages_per_request} pages (model.max_model_len {max_model_len} / scheduler.page_size {s.page_size})")
    return Buckets(tuple(tokens), tuple(pairs), s.max_running_requests, pages_per_request)


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


def build_engine(cfg: AppConfig, progress: bool = True) -> Engine:
    if cfg.worker.compile_cache_dir:
        cache_dir = Path(cfg.worker.compile_cache_dir).expanduser()
        cache_dir.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(cache_dir))
        # Cache every step shape, however quick it was to compile: there are dozens of them.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    layout = make_layout(cfg.parallelism)  # before loading: a wrong device count fails at once
    try:
        checkpoint = open_checkpoint(cfg.model.path)
        model = load_model(checkpoint, cfg.worker.dtype, dummy=cfg.worker.weights == "dummy", seed=cfg.worker.seed,
                           progress=progress, moe=cfg.moe.strategy)
    except CheckpointError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith("model.path") else f"model.path: {message}") from None
    max_model_len = cfg.model.max_model_len or checkpoint.config["max_position_embeddings"]
    buckets = default_buckets(cfg, max_model_len)
    salt = random.SystemRandom().getrandbits(32)  # requests without a seed differ run to run
    facts = {"architectures": ",".join(checkpoint.config.get("architectures", [])), "model_type": checkpoint.config.get("model_type", "")}
    # One device: no layout at all, so the single-device path stays the one measured and tested
    # (the HLO no-copy check) rather than a one-device mesh.
    engine = Engine(model, buckets, cfg.scheduler.page_size, cfg.scheduler.num_pages, salt, facts,
                    layout if layout.mesh.size > 1 else None)
    seconds = engine.compile_all(progress=progress)
    log.info("%d step shapes ready in %.1f s (%s, mesh %s)", engine.compiled, seconds, jax.devices()[0].platform,
             dict(layout.mesh.shape))
    return engine
