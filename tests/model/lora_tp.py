"""Run as a script under four fake CPU devices (test_lora.py reads it; XLA_FLAGS must be set before jax
starts): test_lora.py's tiny Llama and its three PEFT adapters, the model loaded into its shards under
tp2 (the adapter slots replicated), the requests mixing the three adapters and the base model run
through the real scheduler core; writes each request's greedy tokens and logits, ours and those of its
adapter's model merged by peft, to an .npz in a new temporary directory, whose path is the last line
printed (the test reads it, then removes the directory). Run as tests/background.py runs it, in the
suite's idle time.

    python -m tests.model.lora_tp
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax
import numpy as np

from jaxstream.config import load_config
from worker_svc.sharding import make_layout


def main() -> None:
    from tests.model.test_lora import PROMPTS, engine_with_adapters, expected, run_mixed, saved  # not at collection

    work = Path(tempfile.mkdtemp(prefix="lora_tp-"))
    models, dirs = saved("Llama", work)
    parallelism = load_config(["parallelism=tp2"]).parallelism
    engine = engine_with_adapters(work, dirs, make_layout(parallelism, jax.devices()[:parallelism.tensor]))
    prompts, traces = run_mixed(engine, {rid: rid for rid in PROMPTS})
    results = {}
    for rid, prompt in prompts.items():
        tokens, logits = expected(models[rid], prompt)
        results |= {f"{rid}/tokens": np.asarray(traces[rid].tokens), f"{rid}/logits": np.stack(traces[rid].logits),
                    f"{rid}/peft_tokens": np.asarray(tokens), f"{rid}/peft_logits": logits}
    np.savez(work / "runs.npz", **results)
    print(work / "runs.npz", flush=True)


if __name__ == "__main__":
    main()
