"""The compiled pieces of a step (engine.py runs them): the model's forward pass per (tokens, pairs,
page list columns) bucket, sampling, penalties and token masks per rows bucket, prompt scoring per
tokens bucket, and the empty KV cache. Each is lowered from abstract shapes (the step inputs' own
`shapes`, the state's shapes and shardings), compiled at start-up by `compile_all` (or loaded from
the on-disk cache) and kept in a table by its bucket: a step looks its pieces up, and a shape
compiled after start-up is counted (`compiles_after_ready`: any is a bug).

Every part compiles separately. Compiled together, sampling's code (searches over the vocabulary)
would be compiled again for every forward shape, more than doubling start-up.

Under a layout, what one executable hands another is replicated (the step's logits and hidden
states, the processed logits), so each compiles for the same input shardings; the cache keeps its
own.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxstream.protocol import MAX_TOP_LOGPROBS
from worker_svc.batch import Buckets, SubStep
from worker_svc.compiles import counter
from worker_svc.constrained import bitmask_width
from worker_svc.inputs import ScoreInputs, StepInputs, sample_slots
from worker_svc.layers import abstract
from worker_svc.layers.attention import KVCache, to_cache
from worker_svc.layers.paged import PAGED, STATE_DTYPE
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.penalties import PenaltyInputs, apply_penalties
from worker_svc.layers.sampling import Sampled, SamplingInputs, sample, top_count
from worker_svc.layers.token_mask import apply_token_mask
from worker_svc.progress import Report, reporter
from worker_svc.routed import ExpertsCapture, write as write_routed
from worker_svc.scoring import score
from worker_svc.sharding import Layout


def forward(graph: nnx.GraphDef, params: nnx.State, cache: KVCache, inputs: StepInputs, last: jax.Array,
            experts: jax.Array | None = None) -> tuple:
    """One step's model pass: (logits [R, V] float32, final hidden states [T, D], the cache with
    this step's tokens written). last [B] int32: each slot's last sampled token. With the routed
    experts buffer [Y, L, k] (routed.py; None: the switch is off, nothing of it compiled), two more:
    the buffer with this step's rows written, and the step's routed experts [L, T, k] int32."""
    model = nnx.merge(graph, params)
    tokens = jnp.where(inputs.follow >= 0, jnp.take(last, inputs.follow, mode="clip"), inputs.tokens)
    # sample_at has a row per row the step may hold (batch.py's Buckets.rows): the bound on its rows
    logits, hidden, new, *routed = model(tokens, inputs.ctx, cache, inputs.sample_at, experts=experts is not None,
                                         rows=inputs.sample_at.shape[0])
    # One new-entries array [L, T, *per token] per paged array (v None for a latent cache: layers/paged.py);
    # the per-slot states (linear attention's) come back whole, already written in place (layers/states.py)
    slots, (paged, *written) = _two_writes(inputs.write_slot, (KVCache(new.k, new.v), *routed))
    cache = jax.tree.map(lambda pages, entries: _write(pages, entries, slots), KVCache(cache.k, cache.v), paged)
    cache = cache._replace(conv=new.conv, state=new.state)
    if experts is None:
        return logits, hidden, cache
    return logits, hidden, cache, write_routed(experts, written[0], slots), routed[0]


def _two_writes(slots: jax.Array, new: tuple[jax.Array, ...]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """slots [T] and what a step writes into them (each [L, T, ...]), padded to two tokens when T
    is 1 (a slot out of range, dropped). XLA rewrites a one-index scatter into a guarded
    dynamic-update-slice, for which XLA:CPU copies the whole buffer (the KV cache); two indices stay
    a scatter, in place. The rest of a one-token step runs at one token (batch.py, MIN_TOKENS)."""
    if slots.shape[0] != 1:
        return slots, new
    dropped = jnp.full((1,), jnp.iinfo(slots.dtype).max, slots.dtype)
    return jnp.concatenate([slots, dropped]), jax.tree.map(lambda x: jnp.concatenate([x, jnp.zeros_like(x)], axis=1), new)


def sample_rows(numerics: Numerics, logits: jax.Array, inputs: SamplingInputs, raw: jax.Array, last: jax.Array,
                slots: jax.Array, width: int = MAX_TOP_LOGPROBS) -> tuple[Sampled, jax.Array]:
    """Sample (layers/sampling.py) and keep each row's token in its slot of `last` [B] (slots [R];
    padding rows' are out of range: dropped). Row-wise: in tiles under batch_invariant. `width`:
    the alternatives' (sample's)."""
    out = numerics.rowwise(partial(sample, own_normalizer=numerics.batch_invariant, width=width), logits, inputs, raw)
    return out, last.at[slots].set(out.tokens, mode="drop")


def _write(pages: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """pages [L, P, Z, ...], new [L, T, ...] (a cache array and its entries: [K, H] per token, or a
    latent's [1, R + Dr]): scatter each token into its slot (page slot // Z,
    position slot % Z), in place (the cache is donated and nothing reads it after this). Padding
    slots are out of range: dropped. At least two tokens (`_two_writes`), so this stays a scatter.
    Indexed as it lies, not through a reshape to [L, P * Z, K, H]: with an axis of size 1 (one KV
    head, or one per tensor-parallel shard) XLA:CPU laid such a reshape's result out with that axis
    moved and copied the whole cache back, twice per array and step."""
    page_size = pages.shape[2]
    return pages.at[:, slots // page_size, slots % page_size].set(to_cache(new, pages.dtype), mode="drop")


def _empty_cache(shapes: KVCache, dtype: Any) -> KVCache:
    return KVCache(*(None if shape is None else jnp.zeros(shape, dt) for shape, dt in zip(shapes, _dtypes(dtype))))


def _dtypes(dtype: Any) -> tuple:
    """Each KVCache field's dtype: the paged arrays' storage `dtype`, the states' STATE_DTYPE."""
    return tuple(dtype if name in PAGED else STATE_DTYPE for name in KVCache._fields)


def _shaped(tree: Any, sharded: bool = False) -> Any:
    """Shapes and dtypes of a tree of arrays, with their shardings when `sharded`."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding if sharded else None), tree)


class Executables:
    """The compiled pieces of the engine's steps, by bucket. Built from the engine's state as placed
    (`params`, `last`, the routed experts' buffer): its shapes, dtypes and shardings, which a weight
    swap, a release and a resume keep. The cache's are given (`cache_shapes`: a KVCache of each
    array's shape, from the model's CacheSpec; `cache_dtype`; `cache_sharding`: a KVCache of
    shardings, None without a layout); `empty_cache` makes one. `masks`: compile the token
    masks (a worker with constrained decoding). `max_logprobs` (server.max_logprobs; -1: the
    vocabulary): past MAX_TOP_LOGPROBS, a second sampler and prompt scorer per bucket whose
    alternatives are that wide (`wide`), compiled beside the others and run only in a step where
    some request asks past the fixed width: every other step runs the same executables as without."""

    def __init__(self, graph: nnx.GraphDef, params: nnx.State, last: jax.Array, cache_shapes: KVCache, cache_dtype: Any,
                 cache_sharding: KVCache | None, buckets: Buckets, numerics: Numerics, vocab: int, layout: Layout | None,
                 experts: ExpertsCapture | None, masks: bool, max_logprobs: int = MAX_TOP_LOGPROBS, lora: Any = None) -> None:
        # `lora` (adapters.py's AdapterSlots): the steps compile with its slot arrays in ctx.lora; None: nothing of them
        self.lora = lora
        self.graph, self.buckets, self.vocab, self.layout, self.experts, self.masks = graph, buckets, vocab, layout, experts, masks
        # The wide executables' width (a count of alternatives, or -1: all V); 0: none compiled
        self.wide = max_logprobs if top_count(vocab, max_logprobs) > top_count(vocab) else 0
        sharded = layout is not None
        self._params, self._last = _shaped(params, sharded), _shaped(last)
        self._cache = KVCache(*(None if shape is None else jax.ShapeDtypeStruct(shape, dt, sharding=on)
                                for shape, on, dt in zip(cache_shapes, cache_sharding or (None,) * len(cache_shapes),
                                                         _dtypes(cache_dtype))))
        self._experts = None if experts is None else _shaped(experts.buffer, sharded)
        # An empty cache, made on the device (compiled with the step shapes: a resume after a
        # release makes another without compiling, and without a host copy of its size).
        self._empty_cache = jax.jit(partial(_empty_cache, cache_shapes, cache_dtype), out_shardings=cache_sharding)
        outs = {} if layout is None else {"out_shardings": (layout.replicated, layout.replicated, cache_sharding)}
        if experts is not None:
            outs = outs and {"out_shardings": (*outs["out_shardings"], layout.replicated, layout.replicated)}
        self._forward = jax.jit(forward, static_argnums=0, donate_argnums=2 if experts is None else (2, 5), **outs)
        self._sample = jax.jit(partial(sample_rows, numerics))
        self._sample_wide = jax.jit(partial(sample_rows, numerics, width=self.wide))
        self._penalize = jax.jit(apply_penalties, **({} if layout is None else {"out_shardings": layout.replicated}))
        self._score = jax.jit(score, static_argnums=0)
        self._score_wide = jax.jit(partial(score, width=self.wide), static_argnums=0)
        self._mask = jax.jit(apply_token_mask, **({} if layout is None else {"out_shardings": layout.replicated}))
        self.forwards: dict[tuple[int, int, int], Any] = {}  # (tokens, pairs, page list columns) -> executable
        self.samplers: dict[int, Any] = {}  # rows -> executable
        self.penalizers: dict[int, Any] = {}  # rows -> executable
        self.scorers: dict[int, Any] = {}  # tokens -> executable
        self.maskers: dict[int, Any] = {}  # rows -> executable
        self.wide_samplers: dict[int, Any] = {}  # rows -> executable, with `wide`
        self.wide_scorers: dict[int, Any] = {}  # tokens -> executable, with `wide`
        self._zeros: dict[tuple[tuple[int, ...], Any], jax.Array] = {}  # stand-ins for absent dense inputs
        self._hidden: jax.ShapeDtypeStruct | None = None  # of one token's final hidden state
        self.compiles_at_ready: int | None = None

    @property
    def compiles_after_ready(self) -> int:
        return 0 if self.compiles_at_ready is None else counter().count - self.compiles_at_ready

    @property
    def compiled(self) -> int:
        return (len(self.forwards) + len(self.samplers) + len(self.penalizers) + len(self.scorers) + len(self.maskers)
                + len(self.wide_samplers) + len(self.wide_scorers) + (len(self.experts.lookups) if self.experts else 0))

    def compile_all(self, progress: bool | Report = True) -> float:
        """Compile every bucket shape (loading it from the on-disk cache when there); returns seconds."""
        report = reporter(progress)
        counter()  # listen before the first compile
        started = time.perf_counter()
        rows = sorted({self.buckets.rows(t) for t in self.buckets.tokens})
        work = [(self.forwards, shape, self.lower_forward) for shape in self.buckets.shapes()]
        work += [(self.samplers, r, self.lower_sample) for r in rows]
        work += [(self.penalizers, r, self.lower_penalties) for r in rows]
        work += [(self.scorers, t, self.lower_score) for t in self.buckets.tokens]
        if self.masks:
            work += [(self.maskers, r, self.lower_mask) for r in rows]
        if self.wide:
            work += [(self.wide_samplers, r, partial(self.lower_sample, wide=True)) for r in rows]
            work += [(self.wide_scorers, t, partial(self.lower_score, wide=True)) for t in self.buckets.tokens]
        if not isinstance(self._empty_cache, jax.stages.Compiled):
            self._empty_cache = self._empty_cache.lower().compile()
        if self.experts is not None:
            self.experts.compile()
        if self.lora is not None:  # an adapter's load writes its slot between steps: compiled now, not at the first load
            self.lora.warm()
        for i, (table, key, lower) in enumerate(work, 1):
            table[key] = lower(key).compile()
            if report:
                report("compiling step shapes", i, len(work), time.perf_counter() - started)
        self.compiles_at_ready = counter().count
        return time.perf_counter() - started

    def empty_cache(self) -> KVCache:
        return self._empty_cache()

    # A step's pieces, compiled on first use where compile_all did not run (a test of a few shapes):
    # the compile counter makes that visible, and the serving worker always calls compile_all first.

    def forward(self, shape: tuple[int, int, int]) -> Any:
        """The forward pass of a sub-step of `shape` (batch.py's SubStep.shape)."""
        return _executable(self.forwards, shape, self.lower_forward)

    def score(self, params: nnx.State, sub: SubStep, hidden: jax.Array, wide: bool = False) -> tuple[jax.Array, ...]:
        """The prompt scores of a sub-step that scores (scoring.py), from its final hidden states;
        `wide`: with the wide executable's alternatives."""
        tokens = sub.shape[0]
        inputs = self._absent_as_zeros(sub.score, ScoreInputs.shapes(tokens, self.buckets.rows(tokens), self.vocab))
        table = self.wide_scorers if wide else self.scorers
        return _executable(table, tokens, partial(self.lower_score, wide=wide))(params, hidden, inputs)

    def sample(self, sub: SubStep, logits: jax.Array, last: jax.Array, masks: np.ndarray | None = None,
               wide: bool = False) -> tuple[Sampled, jax.Array]:
        """A sub-step's sampled rows from its logits, after its penalties and its token masks when it
        has them, and `last` with each row's token in its slot; `wide`: with the wide executable's
        alternatives."""
        rows = len(sub.sampling.seed)
        processed = logits
        if sub.penalties is not None:
            penalties = self._absent_as_zeros(sub.penalties, PenaltyInputs.shapes(rows, self.vocab))
            processed = _executable(self.penalizers, rows, self.lower_penalties)(logits, penalties)
        if masks is not None:
            processed = _executable(self.maskers, rows, self.lower_mask)(processed, masks)
        sampler = _executable(self.wide_samplers, rows, partial(self.lower_sample, wide=True)) if wide else (
            _executable(self.samplers, rows, self.lower_sample))
        return sampler(processed, sub.sampling, logits, last, sub.sample_slot)

    def lower_forward(self, shape: tuple[int, int, int]) -> jax.stages.Lowered:
        experts = () if self._experts is None else (self._experts,)
        t, w, o = shape
        inputs, last = self._replicated((StepInputs.shapes(t, w, o, self.buckets.rows(t)), self._last))
        return self._forward.lower(self.graph, self._params, self._cache, self._with_lora(inputs, t), last, *experts)

    def lower_sample(self, rows: int, wide: bool = False) -> jax.stages.Lowered:
        logits, slots = self._logits(rows), sample_slots(rows, 0, abstract.full)
        return (self._sample_wide if wide else self._sample).lower(*self._replicated((logits, SamplingInputs.shapes(rows), logits, self._last, slots)))

    def lower_penalties(self, rows: int) -> jax.stages.Lowered:
        return self._penalize.lower(*self._replicated((self._logits(rows), PenaltyInputs.shapes(rows, self.vocab))))

    def lower_mask(self, rows: int) -> jax.stages.Lowered:
        bitmask = jax.ShapeDtypeStruct((rows, bitmask_width(self.vocab)), jnp.int32)
        return self._mask.lower(*self._replicated((self._logits(rows), bitmask)))

    def lower_score(self, tokens: int, wide: bool = False) -> jax.stages.Lowered:
        if self._hidden is None:  # whatever dtype the model's activations have
            _, hidden, _ = jax.eval_shape(partial(forward, self.graph), self._params, self._cache,
                                          self._step_inputs(self.buckets.shapes()[0]), self._last)
            self._hidden = jax.ShapeDtypeStruct(hidden.shape[1:], hidden.dtype)
        inputs = ScoreInputs.shapes(tokens, self.buckets.rows(tokens), self.vocab)
        hidden = jax.ShapeDtypeStruct((tokens, *self._hidden.shape), self._hidden.dtype)
        return (self._score_wide if wide else self._score).lower(self.graph, self._params, *self._replicated((hidden, inputs)))

    def _replicated(self, shapes: Any) -> Any:
        """Step inputs' shapes, replicated over the layout's mesh (unchanged without one)."""
        return shapes if self.layout is None else jax.tree.map(lambda s: s.update(sharding=self.layout.replicated), shapes)

    def _step_inputs(self, shape: tuple[int, int, int]) -> StepInputs:
        t, w, o = shape
        return self._with_lora(StepInputs.shapes(t, w, o, self.buckets.rows(t)), t)

    def _with_lora(self, inputs: StepInputs, tokens: int) -> StepInputs:
        """The inputs with the adapter slots' shapes (each where it lives: split as its base weight
        under a layout, adapters.py), where the worker serves adapters."""
        return inputs if self.lora is None else inputs._replace(ctx=inputs.ctx._replace(lora=self.lora.shapes(tokens)))

    def _logits(self, rows: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((rows, self.vocab), jnp.float32)  # [R, V], as `forward` gives them

    def _absent_as_zeros(self, inputs: Any, shapes: Any) -> Any:
        """`inputs` (a NamedTuple group) with each None field replaced by a device array of zeros
        of its shape in `shapes`, kept per shape (no transfer)."""
        absent = {name: self._zeros_like(getattr(shapes, name)) for name in inputs._fields if getattr(inputs, name) is None}
        return inputs._replace(**absent)

    def _zeros_like(self, shape: jax.ShapeDtypeStruct) -> jax.Array:
        key = (shape.shape, shape.dtype)
        if key not in self._zeros:
            self._zeros[key] = jax.device_put(np.zeros(shape.shape, shape.dtype), None if self.layout is None else self.layout.replicated)
        return self._zeros[key]


def _executable(table: dict, key: Any, lower: Any) -> Any:
    """The executable of `key` in `table`, lowered (`lower(key)`) and compiled on first use."""
    if key not in table:
        table[key] = lower(key).compile()
    return table[key]
