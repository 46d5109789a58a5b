"""Run as a script under four fake CPU devices (tests/background.py starts it with
XLA_FLAGS=--xla_force_host_platform_device_count=4, which must be set before jax starts; test_hybrid.py
reads it): each of test_hybrid.py's seeded checkpoints (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), saved to a
new temporary directory, loaded into its shards under tp2 (`fused`: attention and the linear layers
split by head, both states with them) and, for the MoE ones, ep2 (`ep`: the experts split, tokens
exchanged), runs the parity test's requests through the real scheduler core (chunked prefill beside
decode); and (INVARIANT) the family's model under batch_invariant, a request alone and among others
(invariant_check.py's). Writes each (family, run)'s greedy tokens and logits per request, the tp2 forward
step's collectives and its number of layer stacks, a state shard's shape and the step's copies of one
whole (hlo_check.py's copies_of), and the batch_invariant
outputs, to an .npz whose path is the last line printed (the test reads it, then removes the directory).

    python -m tests.model.hybrid_tp
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import jax
import numpy as np

from jaxstream.config import load_config
from tests.model.parity import BUCKETS, BUDGET, NUM_PAGES, PAGE_SIZE, random_prompts
from tests.worker.driver import Driver
from tests.worker.hlo_check import copies_of
from tests.worker.invariant_check import alone_and_crowd
from worker_svc.engine import Engine
from worker_svc.layers.numerics import Numerics
from worker_svc.loading import load_model
from worker_svc.sharding import make_layout
from worker_svc.weights import open_checkpoint

RUNS = {"tp2": ("tp2", "fused"), "ep2": ("ep2", "ep")}  # run -> (parallelism, MoE strategy); ep2 for the MoE families
# batch_invariant on the two input projections' layouts (Qwen3-Next's: also a MoE and a dense MLP); Qwen3.5-MoE
# adds nothing the two lack; PLAIN, also run alone without the mode
INVARIANT, PLAIN = ("qwen3_5", "qwen3_next"), "qwen3_next"
COLLECTIVE = re.compile(r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")


def main(work: Path) -> Path:
    from tests.model.test_hybrid import FAMILIES, GREEDY, NUMBERS, hf_model  # the test's own; imported here, not at collection

    results = {}
    requests = [(f"p{i}", p, GREEDY) for i, p in enumerate(random_prompts(NUMBERS["vocab_size"]))]
    for family in FAMILIES:
        hf_model(family).save_pretrained(work / family)
        checkpoint = open_checkpoint(work / family)
        for run, (parallelism, strategy) in RUNS.items():
            if run == "ep2" and "num_experts" not in checkpoint.config:
                continue
            sizes = load_config([f"parallelism={parallelism}"]).parallelism
            layout = make_layout(sizes, jax.devices()[:sizes.tensor * sizes.expert])
            model = load_model(checkpoint, progress=False, moe=strategy, layout=layout)
            engine = Engine(model, BUCKETS, PAGE_SIZE, NUM_PAGES, layout=layout)
            driver = Driver(engine, PAGE_SIZE, NUM_PAGES, budget=BUDGET, max_running=4, keep_logits=True, prefix_cache=False)
            for rid, trace in driver.run(requests).items():
                results[f"{family}/{run}/{rid}/tokens"] = np.asarray(trace.tokens)
                results[f"{family}/{run}/{rid}/logits"] = np.stack(trace.logits)
            if run == "tp2":  # the forward step's collectives at the step shape of most tokens
                shape = BUCKETS.shapes()[-1]
                hlo = engine.executables.lower_forward(shape).compile().as_text()
                results[f"{family}/tp2/collectives"] = np.asarray([f"{op} {shape}" for shape, op in COLLECTIVE.findall(hlo)])
                results[f"{family}/tp2/stacks"] = np.asarray(len(model.stack_layers))
                results[f"{family}/tp2/tokens_per_step"] = np.asarray(shape[0])
                shards = {name: array.addressable_shards[0].data.shape for name, array in zip(("conv", "state"), engine.cache.states)}
                results[f"{family}/tp2/state_shards"] = np.asarray(json.dumps(shards))
                results[f"{family}/tp2/state_copies"] = np.asarray(copies_of(hlo, shards.values()), str)
        if family not in INVARIANT:
            continue
        model = load_model(checkpoint, progress=False)
        alone, crowd = alone_and_crowd(type(model), model.cfg, Numerics(batch_invariant=True))
        # one family's same runs without the mode (the chunked delta rule): alone, the token-by-token rule's function;
        # in the crowd, moved (so the check is not vacuous)
        plain = alone_and_crowd(type(model), model.cfg, Numerics()) if family == PLAIN else (None, None)
        results[f"{family}/batch_invariant"] = np.asarray(json.dumps({"alone": alone, "crowd": crowd, "plain": plain}))
    np.savez(work / "runs.npz", **results)
    return work / "runs.npz"


if __name__ == "__main__":
    print(main(Path(tempfile.mkdtemp(prefix="hybrid_tp-"))), flush=True)
