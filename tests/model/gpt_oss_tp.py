"""Run as a script under four fake CPU devices (test_gpt_oss.py starts it with
XLA_FLAGS=--xla_force_host_platform_device_count=4, which must be set before jax starts): the
transformers checkpoint in DIRECTORY, loaded into its shards under tp2 (`fused`; attention split by
head, the experts' F by the `mlp` rule), ep2 (`ep`: the experts split, tokens exchanged) and
tp2_ep2 (`ep`, both), runs the parity test's requests through the real scheduler core; writes each layout's greedy tokens
and logits per request to OUT (an .npz). Without arguments (as tests/background.py runs it, in the suite's
idle time), the checkpoint is test_gpt_oss.py's seeded hf_model, saved to a new temporary directory, and
the last line printed is OUT's path (the test reads it, then removes the directory).

    python -m tests.model.gpt_oss_tp [DIRECTORY OUT]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

from jaxstream import protocol
from jaxstream.config import load_config
from tests.model.parity import BUCKETS, NEW_TOKENS, NUM_PAGES, PAGE_SIZE, random_prompts, run_with_a_prefix_hit
from worker_svc.engine import Engine
from worker_svc.loading import load_model
from worker_svc.sharding import make_layout
from worker_svc.weights import open_checkpoint

LAYOUTS = {"tp2": "fused", "ep2": "ep", "tp2_ep2": "ep"}  # parallelism file -> the MoE strategy served with it
GREEDY = protocol.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def parity_requests(vocab: int) -> list[tuple[str, list[int]]]:
    """test_families.py's: the prompts, then one whose first 48 tokens (6 whole pages) are the long one's."""
    prompts = random_prompts(vocab)
    hit = prompts[0][:48] + np.random.default_rng(1).integers(0, vocab, 9).tolist()
    return [(f"p{i}", p) for i, p in enumerate(prompts)] + [("hit", hit)]


def main(directory: str, out: str) -> None:
    checkpoint = open_checkpoint(directory)
    results = {}
    for name, strategy in LAYOUTS.items():
        parallelism = load_config([f"parallelism={name}"]).parallelism
        layout = make_layout(parallelism, jax.devices()[:parallelism.tensor * parallelism.expert])
        engine = Engine(load_model(checkpoint, progress=False, moe=strategy, layout=layout), BUCKETS, PAGE_SIZE, NUM_PAGES,
                        layout=layout)
        traces = run_with_a_prefix_hit(engine, parity_requests(checkpoint.config["vocab_size"]), GREEDY)
        for rid, trace in traces.items():
            results[f"{name}/{rid}/tokens"] = np.asarray(trace.tokens)
            results[f"{name}/{rid}/logits"] = np.stack(trace.logits)
    np.savez(out, **results)


def in_a_temporary_directory() -> None:
    from tests.model.test_gpt_oss import hf_model  # the test's own seeded model; imported here, not at collection

    work = Path(tempfile.mkdtemp(prefix="gpt_oss_tp-"))
    hf_model().save_pretrained(work / "model")
    main(str(work / "model"), str(work / "runs.npz"))
    print(work / "runs.npz", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:]) if len(sys.argv) > 1 else in_a_temporary_directory()
