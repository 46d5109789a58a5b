"""Run as a script under four fake CPU devices (tests/background.py starts it with
XLA_FLAGS=--xla_force_host_platform_device_count=4, which must be set before jax starts; test_deepseek.py
reads it): each of test_deepseek.py's seeded checkpoints (V3 and V2), saved to a new temporary directory,
loaded into its shards under tp2 (`fused`: heads split, the latent cache replicated; the cache read
through pairs), ep2 (`ep`: the experts split, tokens exchanged), and on one device under batch_invariant, runs the parity test's requests
through the real scheduler core (chunked prefill, decode through the paged latent cache, a prefix-cache
hit). Writes each (family, run)'s greedy tokens and logits per request, and the copies of a cache array's
shard in its compiled forward steps, to an .npz whose path is the last line printed (the test reads it,
then removes the directory).

    python -m tests.model.deepseek_tp
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np

from jaxstream.config import load_config
from tests.model.gpt_oss_tp import GREEDY, parity_requests
from tests.model.parity import BUCKETS, NUM_PAGES, PAGE_SIZE, run_with_a_prefix_hit
from tests.worker.tp_check import cache_copies
from worker_svc.engine import Engine
from worker_svc.layers.numerics import Numerics
from worker_svc.loading import load_model
from worker_svc.sharding import make_layout
from worker_svc.weights import open_checkpoint

# run -> (parallelism, MoE strategy, numerics, how steps read the cache): between them and test_deepseek.py's
# own run (page lists), every way attention reads the latent cache: page lists, pairs, ordered_attention's pairs
RUNS = {"tp2": ("tp2", "fused", Numerics(), replace(BUCKETS, page_list_tokens=0)), "ep2": ("ep2", "ep", Numerics(), BUCKETS),
        "batch_invariant": (None, "fused", Numerics(batch_invariant=True), BUCKETS)}


def main(work: Path) -> Path:
    from tests.model.test_deepseek import FAMILIES, hf_model  # the test's own seeded models; imported here, not at collection

    results = {}
    for family in FAMILIES:
        hf_model(family).save_pretrained(work / family)
        checkpoint = open_checkpoint(work / family)
        for run, (parallelism, strategy, numerics, buckets) in RUNS.items():
            layout = None
            if parallelism is not None:
                sizes = load_config([f"parallelism={parallelism}"]).parallelism
                layout = make_layout(sizes, jax.devices()[:sizes.tensor * sizes.expert])
            engine = Engine(load_model(checkpoint, progress=False, moe=strategy, layout=layout, numerics=numerics), buckets,
                            PAGE_SIZE, NUM_PAGES, layout=layout)
            traces = run_with_a_prefix_hit(engine, parity_requests(checkpoint.config["vocab_size"]), GREEDY)
            for rid, trace in traces.items():
                results[f"{family}/{run}/{rid}/tokens"] = np.asarray(trace.tokens)
                results[f"{family}/{run}/{rid}/logits"] = np.stack(trace.logits)
            shard = engine.cache.k.addressable_shards[0].data.shape
            results[f"{family}/{run}/cache_copies"] = np.asarray(
                sum(cache_copies(f.as_text(), shard) for f in engine.executables.forwards.values()))
    np.savez(work / "runs.npz", **results)
    return work / "runs.npz"


if __name__ == "__main__":
    print(main(Path(tempfile.mkdtemp(prefix="deepseek_tp-"))), flush=True)
