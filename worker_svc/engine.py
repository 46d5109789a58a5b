"""The JAX engine: parameters and the paged KV cache on the device, compiled steps per bucket.

`step` is the whole hot path: pack the scheduler's Step into bucket-shaped inputs, run the
compiled forward pass (it writes the step's keys and values into the donated cache after every
layer has read it), sample on the device, and read back one token and one logprob per sampled row.

Forward and sampling compile separately: the forward per (tokens, pairs) bucket, sampling per rows
bucket. Compiled together, sampling's code (searches over the vocabulary) would be compiled again
for every forward shape, more than doubling start-up.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxstream.protocol import MAX_BANNED_TOKENS, Step, StepResult
from worker_svc.batch import Buckets, StepInputs, StepPacker
from worker_svc.compiles import counter
from worker_svc.layers.attention import KVCache, PagedContext
from worker_svc.layers.sampling import SamplingInputs, sample
from worker_svc.progress import bar


def forward(graph: nnx.GraphDef, params: nnx.State, cache: KVCache, inputs: StepInputs) -> tuple[jax.Array, KVCache]:
    """One step's model pass: (logits [R, V] float32, the cache with this step's tokens written)."""
    model = nnx.merge(graph, params)
    logits, k, v = model(inputs.tokens, inputs.ctx, cache, inputs.sample_at)
    return logits, KVCache(_write(cache.k, k, inputs.write_slot), _write(cache.v, v, inputs.write_slot))


def _write(pages: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """pages [L, P, S, K, H], new [L, T, K, H]: scatter each token into its slot, in place (the
    cache is donated and nothing reads it after this). Padding slots are out of range: dropped.
    Steps have at least MIN_TOKENS tokens, so this stays a scatter (see batch.py)."""
    layers, num_pages, page_size, kv_heads, head_dim = pages.shape
    flat = pages.reshape(layers, num_pages * page_size, kv_heads, head_dim)
    return flat.at[:, slots].set(new.astype(pages.dtype), mode="drop").reshape(pages.shape)


def _shaped(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


class Engine:
    def __init__(self, model: nnx.Module, buckets: Buckets, page_size: int, num_pages: int, salt: int = 0) -> None:
        cfg = model.cfg
        self.graph, self.params = nnx.split(model)
        self.vocab = cfg.vocab
        dtype = model.embed.table[...].dtype
        shape = (cfg.layers, num_pages, page_size, cfg.kv_heads, cfg.head_dim)  # [L, P, S, K, H]
        self.cache = KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        self.buckets = buckets
        self.packer = StepPacker(buckets, page_size, num_pages, salt)
        self._forward = jax.jit(forward, static_argnums=0, donate_argnums=2)
        self._sample = jax.jit(sample)
        self.forwards: dict[tuple[int, int], Any] = {}  # (tokens, pairs) -> executable
        self.samplers: dict[int, Any] = {}  # rows -> executable
        self.compiles_at_ready: int | None = None
        self.steps = 0
        self.last_step_ms = 0.0
        self.last_logits: list[np.ndarray] = []

    @property
    def compiles_after_ready(self) -> int:
        return 0 if self.compiles_at_ready is None else counter().count - self.compiles_at_ready

    def compile_all(self, progress: bool = True) -> float:
        """Compile every bucket shape (loading it from the on-disk cache when there); returns seconds."""
        counter()  # listen before the first compile
        started = time.perf_counter()
        shapes = self.buckets.shapes()
        rows = sorted({self.buckets.rows(t) for t in self.buckets.tokens})
        total = len(shapes) + len(rows)
        for i, shape in enumerate(shapes, 1):
            self.forwards[shape] = self.lower_forward(shape).compile()
            if progress:
                bar("compiling step shapes", i, total, time.perf_counter() - started)
        for i, r in enumerate(rows, len(shapes) + 1):
            self.samplers[r] = self.lower_sample(r).compile()
            if progress:
                bar("compiling step shapes", i, total, time.perf_counter() - started)
        self.compiles_at_ready = counter().count
        return time.perf_counter() - started

    def lower_forward(self, shape: tuple[int, int]) -> jax.stages.Lowered:
        t, w = shape
        i32 = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)  # noqa: E731
        inputs = StepInputs(i32(t), PagedContext(i32(t), i32(t), i32(w), i32(w), i32(w), i32(w)), i32(t), i32(self.buckets.rows(t)))
        return self._forward.lower(self.graph, _shaped(self.params), _shaped(self.cache), inputs)

    def lower_sample(self, rows: int) -> jax.stages.Lowered:
        def row(dtype):
            return jax.ShapeDtypeStruct((rows,), dtype)

        sampling = SamplingInputs(row(jnp.float32), row(jnp.int32), row(jnp.float32), row(jnp.float32), row(jnp.uint32), row(jnp.int32),
                                  jax.ShapeDtypeStruct((rows, MAX_BANNED_TOKENS), jnp.int32))
        return self._sample.lower(jax.ShapeDtypeStruct((rows, self.vocab), jnp.float32), sampling)

    def stats(self) -> dict[str, int | float]:
        return {"steps": self.steps, "step_ms": round(self.last_step_ms, 2), "compiled_shapes": len(self.forwards) + len(self.samplers),
                "compiles_after_ready": self.compiles_after_ready}

    def step(self, step: Step, keep_logits: bool = False) -> StepResult:
        """Run a Step. With keep_logits, `last_logits` holds each sampled row's logits [V], in
        result order (for parity tests)."""
        started = time.perf_counter()
        rids: list[str] = []
        outputs = []
        for sub in self.packer.pack(step):
            logits, self.cache = self._executable(self.forwards, sub.shape, self.lower_forward)(self.params, self.cache, sub.inputs)
            if sub.rids:
                rows = len(sub.sampling.seed)
                tokens, logprobs = self._executable(self.samplers, rows, self.lower_sample)(logits, sub.sampling)
                rids += sub.rids
                outputs.append((len(sub.rids), tokens, logprobs, logits if keep_logits else None))
        token_ids: list[int] = []
        lps: list[float] = []
        kept: list[np.ndarray] = []
        for n, tokens, logprobs, logits in outputs:
            token_ids += np.asarray(tokens)[:n].tolist()
            lps += np.asarray(logprobs)[:n].tolist()
            if logits is not None:
                kept += list(np.asarray(logits)[:n])
        self.last_logits = kept
        self.steps += 1
        self.last_step_ms = (time.perf_counter() - started) * 1000
        return StepResult(step.step_id, tuple(rids), tuple(token_ids), tuple(lps), self.last_step_ms)

    @staticmethod
    def _executable(table: dict, key: Any, lower: Any) -> Any:
        # Without compile_all (a test of a few shapes) a shape compiles on first use; the compile
        # counter makes that visible, and the serving worker always calls compile_all first.
        if key not in table:
            table[key] = lower(key).compile()
        return table[key]
