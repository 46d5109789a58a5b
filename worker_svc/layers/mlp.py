"""Gated feed-forward (Shazeer, 2020): down(act(gate(x)) * up(x)). SwiGLU's act is SiLU (Llama and
its descendants); GeGLU's the tanh approximation of GELU (Gemma: `gelu_pytorch_tanh`)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.lora import LoraStep, adapted
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.quantized import weight


class SwiGLU(nnx.Module):
    activation = staticmethod(jax.nn.silu)
    ADAPTED = ("gate", "up", "down")  # the projections that add LoRA deltas, where a layer's own MLP (`feed_forward`)
    IN_PLACE = ("gate", "up", "down")  # in a step of few rows, read in place in their stack by a kernel (stack_layer.py)

    def __init__(self, dim: int, hidden: int, *, numerics: Numerics = Numerics(), dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.numerics = numerics
        int8 = numerics.quantization
        self.gate = weight(rngs, (dim, hidden), dim**-0.5, ("embed", "mlp"), (0,), dtype, int8)  # [D, F]
        self.up = weight(rngs, (dim, hidden), dim**-0.5, ("embed", "mlp"), (0,), dtype, int8)  # [D, F]
        self.down = weight(rngs, (hidden, dim), hidden**-0.5, ("mlp", "embed"), (0,), dtype, int8)  # [F, D]

    def __call__(self, x: jax.Array, lora: LoraStep | None = None, layer: jax.Array | None = None) -> jax.Array:
        """x [T, D] -> [T, D]; `lora` (layers/lora.py): the adapters' deltas added, at layer `layer`."""
        matmul = self.numerics.matmul
        gate = adapted(lora, "gate", layer, x, matmul("TD,DF->TF", x, self.gate[...]), self.numerics)
        up = adapted(lora, "up", layer, x, matmul("TD,DF->TF", x, self.up[...]), self.numerics)
        hidden = self.activation(gate) * up
        return adapted(lora, "down", layer, hidden, matmul("TF,FD->TD", hidden, self.down[...]), self.numerics)


def feed_forward(mlp: nnx.Module, x: jax.Array, lora: LoraStep | None, layer: jax.Array) -> jax.Array:
    """A layer's MLP of x [T, D]: a dense one with the adapters' deltas; a mixture of experts as it is
    (its experts are never adapted)."""
    return mlp(x, lora, layer) if isinstance(mlp, SwiGLU) else mlp(x)


class GeGLU(SwiGLU):
    """SwiGLU's weights and names, GELU's tanh approximation in place of SiLU."""

    activation = staticmethod(partial(jax.nn.gelu, approximate=True))
