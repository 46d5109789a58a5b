"""Logit bias, the repetition, frequency and presence penalties and allowed_token_ids, as vLLM
applies them, in order:

    l = logits + bias
    l = l / repetition if l > 0 else l * repetition      for every token seen in the prompt or output
    l = l - frequency * count - presence * (count > 0)   count: the token's occurrences in the output
    l = -inf                                             for every token blocked (not allowed)

Its own small executable per rows bucket, run only for steps where some sampled row uses one of
them, so the plain step never pays for it. A row without any (bias 0, repetition 1, frequency and
presence 0, nothing seen) comes out bit-identical.

Shapes in the legend of worker_svc/__init__.py.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from worker_svc.layers import abstract


class PenaltyInputs(NamedTuple):
    """Per-row penalties of one step, dense over the vocabulary (built on the host)."""

    bias: jax.Array  # [R, V] f32: added to the logits
    seen: jax.Array  # [R, V] bool: the token is in the row's prompt or output
    count: jax.Array  # [R, V] i32: the token's occurrences in the row's output
    repetition: jax.Array  # [R] f32; 1: off
    frequency: jax.Array  # [R] f32; 0: off
    presence: jax.Array  # [R] f32; 0: off
    blocked: jax.Array  # [R, V] bool: the row may not sample the token (its allowed_token_ids leave it out)

    @classmethod
    def padded(cls, rows: int, vocab: int, full: Callable = np.full, bias: bool = True, counts: bool = True,
               blocked: bool = True) -> PenaltyInputs:
        """Every row without any penalty, bias or block (layers/abstract.py). Without `bias`, `counts`
        (seen and count) or `blocked`, those dense fields are None: zeros the engine keeps on the device."""
        def dense(wanted, fill, dtype):
            return full((rows, vocab), fill, dtype) if wanted else None

        return cls(bias=dense(bias, 0.0, np.float32), seen=dense(counts, False, np.bool_), count=dense(counts, 0, np.int32),
                   repetition=full(rows, 1.0, np.float32), frequency=full(rows, 0.0, np.float32), presence=full(rows, 0.0, np.float32),
                   blocked=dense(blocked, False, np.bool_))

    @classmethod
    def shapes(cls, rows: int, vocab: int) -> PenaltyInputs:
        return cls.padded(rows, vocab, abstract.full)


def apply_penalties(logits: jax.Array, p: PenaltyInputs) -> jax.Array:
    """logits [R, V] -> processed logits [R, V] float32."""
    l = logits.astype(jnp.float32) + p.bias
    repetition = p.repetition[:, None]  # [R, 1]
    l = jnp.where(p.seen, jnp.where(l > 0, l / repetition, l * repetition), l)
    count = p.count.astype(jnp.float32)
    l = l - (p.frequency[:, None] * count + p.presence[:, None] * (count > 0))
    return jnp.where(p.blocked, -jnp.inf, l)
