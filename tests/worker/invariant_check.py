"""Run as a script (tests/background.py starts it in the suite's idle time; test_batch_invariant.py reads
it): worker.batch_invariant on each family served since Qwen3, on tp_check.py's tiny random models
(Qwen2's q, k and v biases and a sliding layer, Mistral's windows, Mixtral's experts, Gemma 2's
soft-caps and window, Gemma 3's QK-norm, window and two rotary bases) and a tiny GPT-OSS (sinks, biases,
windows, its MoE with biased experts and the clamped SwiGLU, YaRN) and a tiny DeepSeek-V3 (latent
attention, its MoE). One request, greedy with top logprobs, run alone and then among 12 others of random
lengths (its prompt chunked beside theirs, its decode beside their prefills): prints one JSON line per
family with whether its tokens, logprobs and top logprobs are bit-identical; without the mode, the
largest logprob difference the crowd made (so the check is not vacuous), for one family (MOVED_BY: a
crowd run per family compiled as many step shapes again to show the same); and the largest between
the mode's ordered attention and the default paths, alone (None: other tokens, or not run)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
from flax import nnx

from jaxstream.protocol import SamplingParams
from tests.worker.driver import Driver
from tests.worker.tp_check import MODELS, NUMBERS
from worker_svc.batch import Buckets
from worker_svc.engine import Engine
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.rotary import YarnScaling
from worker_svc.models.deepseek import DeepseekV3, DeepseekV3Config
from worker_svc.models.gpt_oss import GptOss, GptOssConfig

FAMILIES = {name: MODELS[name] for name in ("qwen2", "mistral", "mixtral", "gemma2", "gemma3")}
FAMILIES["gpt_oss"] = (GptOss, GptOssConfig(**NUMBERS, experts=8, top_k=4, windows=(6, 0),
                                            rope_scaling=YarnScaling.of({"factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                                        "original_max_position_embeddings": 64}, 8, 10000.0)))
# DeepSeek-V3: latent attention (low-rank q, YaRN, interleaved rotary) over the latent cache, a dense layer then
# DeepSeek's MoE (groups, a shared expert, the correction bias)
FAMILIES["deepseek"] = (DeepseekV3, DeepseekV3Config(**{k: v for k, v in NUMBERS.items() if k != "kv_heads"}, q_lora_rank=16,
                                                     kv_lora_rank=16, nope_dim=8, v_dim=8, scale=16**-0.5, interleaved=True,
                                                     rope_scaling=YarnScaling.of({"factor": 4.0, "original_max_position_embeddings": 64},
                                                                                 8, 10000.0),
                                                     moe_layers=(1,), experts=8, top_k=2, moe_mlp_dim=16, shared_experts=1,
                                                     n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5))
MOVED_BY = "mistral"  # the family also run in the crowd without the mode (any whose logprobs it moves)
PAGE_SIZE, NUM_PAGES = 4, 256
BUCKETS = Buckets(tokens=(8, 64), pairs=(0, 512), max_rows=16, max_pages=32)  # few shapes: each compiles per family and mode
rng = np.random.default_rng(11)
PROMPT = rng.integers(0, NUMBERS["vocab"], 29).tolist()
TARGET = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True, top_logprobs=3)
OTHERS = [(f"o{i}", rng.integers(0, NUMBERS["vocab"], int(rng.integers(3, 60))).tolist(),
           SamplingParams(max_new_tokens=int(rng.integers(1, 12)), temperature=0.0, ignore_eos=True)) for i in range(12)]


def outputs(trace) -> tuple:
    return trace.tokens, trace.logprobs, [t.tolist() for t in trace.top_logprobs]


def alone_and_crowd(model_cls, cfg, numerics: Numerics, crowd: bool = True) -> tuple[tuple, tuple | None]:
    engine = Engine(model_cls(replace(cfg, numerics=numerics), rngs=nnx.Rngs(3)), BUCKETS, PAGE_SIZE, NUM_PAGES)
    alone = Driver(engine, PAGE_SIZE, NUM_PAGES, 64, 16).run([("t", PROMPT, TARGET)])["t"]
    if not crowd:
        return outputs(alone), None
    among = Driver(engine, PAGE_SIZE, NUM_PAGES, 64, 16).run([*OTHERS, ("t", PROMPT, TARGET)])["t"]
    return outputs(alone), outputs(among)


def main() -> None:
    for family, (model_cls, cfg) in FAMILIES.items():
        alone, crowd = alone_and_crowd(model_cls, cfg, Numerics(batch_invariant=True))
        plain_alone, plain_crowd = alone_and_crowd(model_cls, cfg, Numerics(), crowd=family == MOVED_BY)
        moved = None if plain_crowd is None or plain_alone[0] != plain_crowd[0] else float(
            np.max(np.abs(np.asarray(plain_alone[1]) - np.asarray(plain_crowd[1]))))
        # the mode's ordered attention against the default paths (page lists, pairs, the CPU kernel) alone: the same
        # tokens and logprobs to float tolerance, windows, soft-caps and sinks masked and summed alike
        apart = float(np.max(np.abs(np.asarray(alone[1]) - np.asarray(plain_alone[1])))) if alone[0] == plain_alone[0] else None
        print(json.dumps({"family": family, "identical": alone == crowd, "tokens": len(alone[0]), "same_tokens": alone[0] == crowd[0],
                          "without_mode_moved": moved, "mode_against_default": apart}), flush=True)


if __name__ == "__main__":
    main()
