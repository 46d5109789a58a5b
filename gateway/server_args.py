"""The server's arguments as each peer names them, for the clients that compare them at start-up.

SGLang's `/server_info` is its ServerArgs dataclass whole (http_server.py, `get_server_info`); slime
asserts, for an external engine, that each argument it would have launched with equals the served
one (`enable_memory_saver`, `dtype` with --fp16, `enable_return_routed_experts` with routing
replay), and reads `tp_size`, `pp_size`, `ep_size`, `moe_dp_size`, `disaggregation_mode`. vLLM's
`/server_info?config_format=json` is its VllmConfig (`vllm_config`: `model_config`,
`parallel_config`, `cache_config`, `scheduler_config`, `speculative_config`). Only arguments
with a meaning here are named, each with the value that meaning has (never a guess): a key a peer
has and this server has no counterpart for is absent.
"""

from __future__ import annotations

from jaxstream.config import AppConfig

# vLLM's logprobs_mode names of ours ("sampling", SGLang's definition, has none: it keeps its own)
VLLM_LOGPROBS_MODES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}


def world_size(cfg: AppConfig, include_dp: bool = True) -> int:
    """The devices one replica's mesh spans (tensor x expert axes; no pipeline parallelism here),
    times the replicas when `include_dp`: vLLM's parallel_config counts."""
    devices = cfg.parallelism.tensor * cfg.parallelism.expert
    return devices * cfg.parallelism.data if include_dp else devices


def receiving_ranks(cfg: AppConfig, include_dp: bool = True) -> int:
    """vLLM's /get_world_size, as its RL clients use it: the ranks this server joins a trainer's
    weight-sync group with (SkyRL and TRL size the group as it + 1). One per replica's worker
    process, whatever its devices (worker_svc/collective.py; docs/rl.md), so under tensor or expert
    parallelism it is not the device count vLLM would answer: a group sized by devices would wait
    for ranks that never join."""
    return cfg.parallelism.data if include_dp else 1


def sglang_args(cfg: AppConfig, model_path: str, context: int | None, weight_version: str) -> dict:
    """ServerArgs' names of what is served (`model_path`: where the live weights came from; `context`:
    the tokenizer's max_model_len, None until one reports)."""
    s, w, p = cfg.scheduler, cfg.worker, cfg.parallelism
    return {
        "model_path": model_path,
        "tokenizer_path": cfg.model.tokenizer or cfg.model.path,
        "served_model_name": cfg.model.name,
        "load_format": "dummy" if w.weights == "dummy" or cfg.model.path is None else "auto",
        "dtype": w.dtype,
        "kv_cache_dtype": w.kv_cache_dtype,
        "quantization": w.quantization,  # null, or the weights' method ("int8")
        "random_seed": w.seed,  # of the dummy weights; sampling is seeded per request
        "skip_tokenizer_init": False,
        "is_embedding": False,
        "encoder_only": False,
        "tp_size": p.tensor,
        "dp_size": p.data,
        "ep_size": p.expert,
        "pp_size": 1,
        "moe_dp_size": 1,
        "nnodes": 1,
        "disaggregation_mode": "null",
        # Device memory release and resume always work here (what SGLang's flag turns on); the
        # weights' values are not kept on the host (SGLang's enable_weights_cpu_backup): a resume
        # awaits the trainer's next update (docs/rl.md)
        "enable_memory_saver": True,
        "enable_weights_cpu_backup": False,
        # the workers' own word (their heartbeat facts) decides whether a request gets them: admin_routes
        "enable_return_routed_experts": w.enable_return_routed_experts,
        "enable_deterministic_inference": w.batch_invariant,  # SGLang's name for the batch-invariant mode
        "batch_invariant": w.batch_invariant,
        "enable_fp32_router": w.router_fp32,  # xorl-sglang's
        "enable_fp32_lm_head": w.lm_head_fp32,
        "page_size": s.page_size,
        "max_running_requests": s.max_running_requests,
        "max_queued_requests": s.max_queued_requests,
        "chunked_prefill_size": s.max_tokens_per_step,
        "max_prefill_tokens": s.max_tokens_per_step,
        "schedule_policy": s.policy,
        "disable_radix_cache": not s.prefix_cache,
        "disable_overlap_schedule": not s.overlap,
        "speculative_algorithm": "NGRAM" if s.speculative == "ngram" else None,
        "speculative_num_draft_tokens": s.num_speculative_tokens if s.speculative == "ngram" else None,
        "max_total_num_tokens": s.num_pages * s.page_size,
        "context_length": context,
        "max_req_input_len": context - 1 if context else None,
        "enable_metrics": True,
        "weight_version": weight_version,
        "world_size": receiving_ranks(cfg),  # SkyRL's /get_server_info reads it: the ranks a weight sync joins
    }


def vllm_config(cfg: AppConfig, model_path: str, context: int | None) -> dict:
    """VllmConfig's groups, with the keys clients read (their model, its parallel layout, the KV
    cache and scheduler limits), as `/server_info?config_format=json` gives them."""
    s, w, p = cfg.scheduler, cfg.worker, cfg.parallelism
    speculative = None
    if s.speculative == "ngram":
        speculative = {"method": "ngram", "num_speculative_tokens": s.num_speculative_tokens,
                       "prompt_lookup_max": s.prompt_lookup_max, "prompt_lookup_min": s.prompt_lookup_min}
    return {
        "model_config": {
            "model": model_path, "served_model_name": cfg.model.name, "tokenizer": cfg.model.tokenizer or cfg.model.path,
            "dtype": w.dtype, "max_model_len": context, "seed": w.seed, "quantization": w.quantization,
            "max_logprobs": cfg.server.max_logprobs, "logprobs_mode": VLLM_LOGPROBS_MODES.get(cfg.server.logprobs_mode, cfg.server.logprobs_mode),
            "skip_tokenizer_init": False,
        },
        "parallel_config": {
            "tensor_parallel_size": p.tensor, "pipeline_parallel_size": 1, "data_parallel_size": p.data,
            "enable_expert_parallel": p.expert > 1, "world_size": world_size(cfg, include_dp=False),
            "world_size_across_dp": world_size(cfg),
        },
        "cache_config": {"block_size": s.page_size, "num_gpu_blocks": s.num_pages, "enable_prefix_caching": s.prefix_cache,
                         "cache_dtype": w.kv_cache_dtype},
        "scheduler_config": {"max_num_seqs": s.max_running_requests, "max_num_batched_tokens": s.max_tokens_per_step,
                             "enable_chunked_prefill": True, "max_model_len": context},
        "speculative_config": speculative,
    }
