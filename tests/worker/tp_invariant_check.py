"""worker.batch_invariant under tp2, as a script (XLA_FLAGS must be set before jax starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m tests.worker.tp_invariant_check

test_batch_invariant.py's request alone and after 31 others, on 2 fake CPU devices with the tp2
layout (vocab 212: the head's rows must split in two). Prints whether the two are bit-identical."""

from dataclasses import replace

import jax
from flax import nnx

from jaxstream.config import load_config
from tests.worker import test_batch_invariant as t
from tests.worker.driver import Driver
from worker_svc.engine import Engine
from worker_svc.layers.numerics import Numerics
from worker_svc.models.qwen3_moe import Qwen3Moe
from worker_svc.sharding import make_layout


def main() -> None:
    layout = make_layout(load_config(["parallelism=tp2"]).parallelism, jax.devices()[:2])
    cfg = replace(t.MOE, vocab=212, numerics=Numerics(batch_invariant=True))
    engine = Engine(Qwen3Moe(cfg, rngs=nnx.Rngs(3)), t.WIDE, t.PAGE_SIZE, t.NUM_PAGES, layout=layout)
    alone = t.outputs(Driver(engine, t.PAGE_SIZE, t.NUM_PAGES, 64, 32).run([("alone", t.PROMPT, t.TARGET)])["alone"])
    crowd = Driver(engine, t.PAGE_SIZE, t.NUM_PAGES, 64, 32).run([*t.OTHERS, ("crowd", t.PROMPT, t.TARGET)])["crowd"]
    crowd = t.outputs(crowd)
    print("tp2, batch_invariant: " + ("bit-identical" if crowd == alone else f"differs by {t.max_difference(crowd, alone)}"))


if __name__ == "__main__":
    main()
