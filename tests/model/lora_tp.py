"""Run as a script under four fake CPU devices (test_lora.py reads it; XLA_FLAGS must be set before jax
starts): test_lora.py's tiny Llama and its three PEFT adapters, the model loaded into its shards under
tp2 (each adapter's A and B split as its base weight: sharding.py's `lora_shardings`), and a tiny
Qwen3-MoE with three attention adapters under ep2 (its experts split, the attention and its adapters
whole); the requests mixing the three adapters and the base model run through the real scheduler core.
Writes each request's greedy tokens and logits, ours and those of its adapter's model merged by peft,
and the collectives of the Llama's compiled forward step with and without the adapter slots (op and
shape, one per line of the HLO), to an .npz in a new temporary directory, whose path is the last line
printed (the test reads it, then removes the directory). Run as tests/background.py runs it, in the
suite's idle time.

    python -m tests.model.lora_tp
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import jax
import numpy as np

from jaxstream.config import load_config
from worker_svc.engine import Engine
from worker_svc.loading import load_model
from worker_svc.sharding import make_layout
from worker_svc.weights import open_checkpoint

COLLECTIVE = re.compile(r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def main() -> None:
    from tests.model.test_lora import BUCKETS, PAGE_SIZE, NUM_PAGES, PROMPTS, engine_with_adapters, expected, run_mixed, saved

    work = Path(tempfile.mkdtemp(prefix="lora_tp-"))
    results = {}
    for family, layout_name, targets, config, moe in (("Llama", "tp2", None, {}, "fused"), ("Qwen3Moe", "ep2", ATTENTION, MOE, "ep")):
        out = work / family
        models, dirs = saved(family, out, **({"targets": targets} if targets else {}), **config)
        parallelism = load_config([f"parallelism={layout_name}"]).parallelism
        layout = make_layout(parallelism, jax.devices()[:parallelism.tensor * parallelism.expert])
        engine = engine_with_adapters(out, dirs, layout, moe=moe)
        prompts, traces = run_mixed(engine, {rid: rid for rid in PROMPTS})
        for rid, prompt in prompts.items():
            tokens, logits = expected(models[rid], prompt)
            results |= {f"{family}/{rid}/tokens": np.asarray(traces[rid].tokens), f"{family}/{rid}/logits": np.stack(traces[rid].logits),
                        f"{family}/{rid}/peft_tokens": np.asarray(tokens), f"{family}/{rid}/peft_logits": logits}
        if family == "Llama":  # the forward step's collectives, the slots in and out, at the step shape of most tokens
            shape = BUCKETS.shapes()[-1]
            base = Engine(load_model(open_checkpoint(out / "base"), progress=False, layout=layout), BUCKETS, PAGE_SIZE, NUM_PAGES,
                          layout=layout)
            for name, e in (("with_slots", engine), ("without", base)):
                hlo = e.executables.lower_forward(shape).compile().as_text()
                results[f"collectives/{name}"] = np.asarray([f"{op} {shape}" for shape, op in COLLECTIVE.findall(hlo)])
            results["collectives/tokens"] = np.asarray(shape[0])
    np.savez(work / "runs.npz", **results)
    print(work / "runs.npz", flush=True)


if __name__ == "__main__":
    main()
