"""The sampler is one jit per numerics and width in a process (worker_svc/executables.py's `_sampler`):
a second engine's sampler of a shape the first compiled is JAX's in-memory executable, which fires no
compile event; a table miss still counts as a compile (worker_svc/compiles.py), so
`compiles_after_ready` sees a shape lowered after start-up whether or not JAX had it."""

import jax
import jax.numpy as jnp

from jaxstream.protocol import MAX_TOP_LOGPROBS
from worker_svc.compiles import counter
from worker_svc.executables import _executable, _sampler
from worker_svc.inputs import sample_slots
from worker_svc.layers import abstract
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.sampling import SamplingInputs

VOCAB, SLOTS = 97, 8


def lower_sample(rows: int) -> jax.stages.Lowered:
    logits = jax.ShapeDtypeStruct((rows, VOCAB), jnp.float32)
    last = jax.ShapeDtypeStruct((SLOTS,), jnp.int32)
    return _sampler(Numerics(), MAX_TOP_LOGPROBS).lower(logits, SamplingInputs.shapes(rows), logits, last,
                                                        sample_slots(rows, 0, abstract.full))


def test_a_sampler_another_engine_compiled_comes_from_memory_and_still_counts(monkeypatch):
    assert _sampler(Numerics(), MAX_TOP_LOGPROBS) is _sampler(Numerics(), MAX_TOP_LOGPROBS)
    assert _sampler(Numerics(), MAX_TOP_LOGPROBS) is not _sampler(Numerics(batch_invariant=True), MAX_TOP_LOGPROBS)
    bumps = []  # the counts made for a lowering that fired no event: JAX's in-memory executable
    bump = counter().bump
    monkeypatch.setattr(counter(), "bump", lambda: (bumps.append(1), bump()))

    before = counter().count
    _executable({}, 3, lower_sample)  # one engine's table
    assert counter().count - before >= 1  # a compile, or a load from the on-disk cache

    before = counter().count
    _executable({}, 3, lower_sample)  # another engine's: the same program
    assert (counter().count - before, len(bumps)) == (1, 1)  # from memory, counted once

    before = counter().count
    assert _executable({3: "compiled"}, 3, lower_sample) == "compiled"  # a hit in the table lowers nothing
    assert counter().count == before
