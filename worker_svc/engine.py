"""The JAX engine: parameters and the paged KV cache on the device, compiled steps per bucket.

`step` is the whole hot path, per sub-step (batch.py):
  1. Run the compiled forward pass: logits of the sampled rows, the final hidden states of every
     token, and the step's keys and values written into the donated cache after every layer has
     read it. The input token of a seq that follows (overlap: planned before the previous step's
     result) is taken on the device from `last`, the token its slot's row sampled last.
  2. Only when some seq scores prompt positions here: the LM head over their predictors' hidden
     states, their logprobs, alternatives, named ids' logprobs and ranks (scoring.py).
  3. Only when some sampled row uses a penalty or a logit bias: the processed logits
     (layers/penalties.py), from dense rows built on the host out of the requests' token history
     (history.py, fed this Step's tokens first). Only when some sampled row is constrained: its
     token mask, computed on the host while the forward pass runs (constrained.py), then applied
     (layers/token_mask.py).
  4. Sample on the device (layers/sampling.py), keep each row's token in its slot of `last`, and
     read back one token and one logprob per sampled row, and the alternatives when some row asked.
     A seq with a draft (speculative decoding) has a row per draft token and one more; only those
     up to its first token that differs from the draft's are its result (drafts.py).
     The penalties' history and the constrained rows' matchers take the sampled tokens from this
     read-back, before the next step.

Logprobs (docs/design.md): log_softmax(processed / T)[token] in float32 over the whole vocabulary,
processed = after penalties and bias, before top-k/top-p/min-p and bans; T < MIN_TEMPERATURE
(greedy) counts as 1. raw_logprobs: log_softmax(raw logits), T = 1, no penalty or bias.
processed_logprobs (sampled tokens): after the top-k/top-p/min-p cut, renormalized. Prompt
positions take the same rule with the request's temperature and bias and no penalty (they were not
sampled); position 0 has no predictor: NaN, and alternatives with id -1 and logprob NaN. The ids a
request names (token_ids_logprob) get their logprobs under each row's distribution, padded to a
fixed I, computed only when some row asks; a scored prompt token also gets its rank (vLLM's: the
tokens at least as likely, itself included), position 0 rank 0.

Every part compiles separately: the forward per (tokens, pairs) bucket, sampling and penalties
per rows bucket, scoring per tokens bucket. Compiled together, sampling's code (searches over the
vocabulary) would be compiled again for every forward shape, more than doubling start-up.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
from flax import nnx

from jaxstream.arrays import from_wire, to_wire
from jaxstream.protocol import ModelFacts, SamplingParams, Step, StepResult
from worker_svc.batch import Buckets, StepPacker, SubStep
from worker_svc.compiles import counter
from worker_svc.constrained import Constraints, bitmask_width
from worker_svc.drafts import kept_rows
from worker_svc.history import MIN_CAPACITY, TokenHistory
from worker_svc.huge_pages import HugePages, on_huge_pages
from worker_svc.inputs import ScoreInputs, StepInputs, sample_slots
from worker_svc.layers import abstract, attention_kernel
from worker_svc.layers.attention import KVCache, storage_dtype, to_cache
from worker_svc.layers.in_place import hold
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.penalties import PenaltyInputs, apply_penalties
from worker_svc.layers.sampling import NO_TOKEN, Sampled, SamplingInputs, sample, top_count
from worker_svc.layers.token_mask import apply_token_mask
from worker_svc.positions import first_position
from worker_svc.progress import Report, reporter
from worker_svc.routed import ExpertsCapture, write as write_routed
from worker_svc.scoring import prompt_scores, score
from worker_svc.slots import SlotParams
from worker_svc.sharding import CACHE_NAMES, Layout, place_params
from worker_svc.swap import WeightSwap


def forward(graph: nnx.GraphDef, params: nnx.State, cache: KVCache, inputs: StepInputs, last: jax.Array,
            experts: jax.Array | None = None) -> tuple:
    """One step's model pass: (logits [R, V] float32, final hidden states [T, D], the cache with
    this step's tokens written). last [B] int32: each slot's last sampled token. With the routed
    experts buffer [Y, L, k] (routed.py; None: the switch is off, nothing of it compiled), two more:
    the buffer with this step's rows written, and the step's routed experts [L, T, k] int32."""
    model = nnx.merge(graph, params)
    tokens = jnp.where(inputs.follow >= 0, jnp.take(last, inputs.follow, mode="clip"), inputs.tokens)
    logits, hidden, k, v, *routed = model(tokens, inputs.ctx, cache, inputs.sample_at, experts=experts is not None)
    slots, (k, v, *written) = _two_writes(inputs.write_slot, (k, v, *routed))
    cache = KVCache(_write(cache.k, k, slots), _write(cache.v, v, slots))
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
    return jnp.concatenate([slots, dropped]), tuple(jnp.concatenate([x, jnp.zeros_like(x)], axis=1) for x in new)


def sample_rows(numerics: Numerics, logits: jax.Array, inputs: SamplingInputs, raw: jax.Array, last: jax.Array,
                slots: jax.Array) -> tuple[Sampled, jax.Array]:
    """Sample (layers/sampling.py) and keep each row's token in its slot of `last` [B] (slots [R];
    padding rows' are out of range: dropped). Row-wise: in tiles under batch_invariant."""
    out = numerics.rowwise(partial(sample, own_normalizer=numerics.batch_invariant), logits, inputs, raw)
    return out, last.at[slots].set(out.tokens, mode="drop")


def _write(pages: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """pages [L, P, Z, K, H], new [L, T, K, H]: scatter each token into its slot (page slot // Z,
    position slot % Z), in place (the cache is donated and nothing reads it after this). Padding
    slots are out of range: dropped. At least two tokens (`_two_writes`), so this stays a scatter.
    Indexed as it lies, not through a reshape to [L, P * Z, K, H]: with an axis of size 1 (one KV
    head, or one per tensor-parallel shard) XLA:CPU laid such a reshape's result out with that axis
    moved and copied the whole cache back, twice per array and step."""
    page_size = pages.shape[2]
    return pages.at[:, slots // page_size, slots % page_size].set(to_cache(new, pages.dtype), mode="drop")


def _empty_cache(shape: tuple[int, ...], dtype: Any) -> KVCache:
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def _shaped(tree: Any, sharded: bool = False) -> Any:
    """Shapes and dtypes of a tree of arrays, with their shardings when `sharded`."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding if sharded else None), tree)


class Engine:
    def __init__(self, model: nnx.Module, buckets: Buckets, page_size: int, num_pages: int, salt: int = 0,
                 facts: dict[str, str] | None = None, layout: Layout | None = None, routed_experts: bool = False,
                 constraints: Constraints | None = None, weights_in_place: bool = False, kv_cache_dtype: str = "auto",
                 huge_pages: bool = True) -> None:
        """`layout` (sharding.py): the device mesh and logical rules to place the parameters and
        the KV cache with; None keeps everything on the default device, unannotated.
        `routed_experts` (worker.enable_return_routed_experts): capture them (routed.py), when the
        model has MoE layers. `constraints` (constrained.py): the matchers of constrained requests,
        over the model's tokenizer; None: a constrained request is sampled unconstrained (tests
        of other parts). `weights_in_place` (worker.weights_in_place): hold the layer weights per
        layer, read in place (layers/in_place.py). `kv_cache_dtype` (worker.kv_cache_dtype): what
        the KV cache holds (layers/attention.py, `storage_dtype`). `huge_pages` (worker.huge_pages):
        the weights' CPU buffers asked onto 2 MB pages, again after each weight update (huge_pages.py);
        `weight_pages` says what the last asking did."""
        cfg = model.cfg
        moe_layers = len(getattr(cfg, "moe_layers", ()))
        # What the model is (architectures, model_type; what a request for routed experts needs), reported with the stats
        self.facts = ModelFacts(**(facts or {}), moe_layers=moe_layers, num_hidden_layers=cfg.layers,
                                num_experts_per_tok=getattr(cfg, "top_k", 0), enable_return_routed_experts=routed_experts)
        self.graph, self.params = nnx.split(model)
        self.vocab = cfg.vocab
        # The cache's storage, from the model dtype (the table's may be int8: quantized.py)
        model_dtype = model.norm.scale[...].dtype
        dtype = storage_dtype(model_dtype, kv_cache_dtype)
        shape = (cfg.layers, num_pages, page_size, cfg.kv_heads, cfg.head_dim)  # [L, P, Z, K, H]
        self.layout = layout
        on = None
        if layout is not None:
            place_params(self.params, layout)
            on = layout.sharding(CACHE_NAMES, shape, "the KV cache [L, P, Z, K, H]")
        if weights_in_place:
            hold(self.params, model.held_in_place())  # layer weights per layer, read in place (in_place.py)
        self.huge_pages = huge_pages
        self.weight_pages = on_huge_pages(self.params) if huge_pages else HugePages()
        # An empty cache, made on the device (compiled with the step shapes: a resume after a
        # release makes another without compiling, and without a host copy of its size).
        self._empty_cache = jax.jit(partial(_empty_cache, shape, dtype), out_shardings=None if on is None else KVCache(on, on))
        self.cache = self._empty_cache()
        self.released: set[str] = set()  # memory given back (release): no step runs until resumed
        # [B] the token each slot's row sampled last (StepSeq.slot, < the scheduler's max running requests)
        self.last = jax.device_put(np.zeros(buckets.max_rows, np.int32), None if layout is None else layout.replicated)
        if cfg.numerics.batch_invariant:  # its attention (ordered_attention) reads pairs only
            buckets = dataclasses.replace(buckets, page_list_tokens=0)
        buckets = buckets.choose_page_lists(cfg.numerics.attention_kernel and attention_kernel.applies(
            model_dtype, dtype, cfg.heads // cfg.kv_heads, cfg.head_dim))
        self.buckets = buckets
        self.packer = StepPacker(buckets, page_size, num_pages, salt, cfg.vocab, every_page=cfg.numerics.batch_invariant)
        self.history = TokenHistory(max(MIN_CAPACITY, 4 * buckets.max_rows))
        self.slot_params = SlotParams()
        # Under a layout, what one executable hands another is replicated (the step's logits and
        # hidden states, the processed logits), so each compiles for the same input shardings; the
        # cache keeps its own.
        outs = {} if layout is None else {"out_shardings": (layout.replicated, layout.replicated, KVCache(on, on))}
        self.experts = None  # the routed experts capture (routed.py), with the switch on and MoE layers
        if routed_experts and moe_layers:
            self.experts = ExpertsCapture(cfg.layers, cfg.top_k, num_pages * page_size, page_size, buckets.tokens[-1],
                                          None if layout is None else layout.replicated)  # [Y, L, k], replicated
            outs = outs and {"out_shardings": (*outs["out_shardings"], layout.replicated, layout.replicated)}
        self._forward = jax.jit(forward, static_argnums=0, donate_argnums=2 if self.experts is None else (2, 5), **outs)
        self._sample = jax.jit(partial(sample_rows, cfg.numerics))
        self._penalize = jax.jit(apply_penalties, **({} if layout is None else {"out_shardings": layout.replicated}))
        self._score = jax.jit(score, static_argnums=0)
        self.constraints = constraints
        self._mask = jax.jit(apply_token_mask, **({} if layout is None else {"out_shardings": layout.replicated}))
        self.forwards: dict[tuple[int, int, int], Any] = {}  # (tokens, pairs, page list columns) -> executable
        self.samplers: dict[int, Any] = {}  # rows -> executable
        self.penalizers: dict[int, Any] = {}  # rows -> executable
        self.scorers: dict[int, Any] = {}  # tokens -> executable
        self.maskers: dict[int, Any] = {}  # rows -> executable
        self._zeros: dict[tuple[tuple[int, ...], Any], jax.Array] = {}  # stand-ins for absent dense inputs
        self._hidden: jax.ShapeDtypeStruct | None = None  # of one token's final hidden state
        self.compiles_at_ready: int | None = None
        self.steps = 0
        self.last_step_ms = 0.0
        self.last_shapes: list[tuple[int, int, int]] = []  # the last step's compiled shapes, one per sub-step
        self.last_logits: list[np.ndarray] = []
        self.swap = WeightSwap(layout)  # a weight update staged beside `params` (swap.py)

    @property
    def compiles_after_ready(self) -> int:
        return 0 if self.compiles_at_ready is None else counter().count - self.compiles_at_ready

    @property
    def compiled(self) -> int:
        return (len(self.forwards) + len(self.samplers) + len(self.penalizers) + len(self.scorers) + len(self.maskers)
                + (len(self.experts.lookups) if self.experts else 0))

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
        if self.constraints is not None:
            work += [(self.maskers, r, self.lower_mask) for r in rows]
        if not isinstance(self._empty_cache, jax.stages.Compiled):
            self._empty_cache = self._empty_cache.lower().compile()
        if self.experts is not None:
            self.experts.compile()
        for i, (table, key, lower) in enumerate(work, 1):
            table[key] = lower(key).compile()
            if report:
                report("compiling step shapes", i, len(work), time.perf_counter() - started)
        self.compiles_at_ready = counter().count
        return time.perf_counter() - started

    def lower_forward(self, shape: tuple[int, int, int]) -> jax.stages.Lowered:
        sharded = self.layout is not None
        experts = () if self.experts is None else (_shaped(self.experts.buffer, sharded),)
        return self._forward.lower(self.graph, _shaped(self.params, sharded), _shaped(self.cache, sharded),
                                   *self._replicated((self._step_inputs(shape), _shaped(self.last))), *experts)

    def _replicated(self, shapes: Any) -> Any:
        """Step inputs' shapes, replicated over the layout's mesh (unchanged without one)."""
        return shapes if self.layout is None else jax.tree.map(lambda s: s.update(sharding=self.layout.replicated), shapes)

    def _step_inputs(self, shape: tuple[int, int, int]) -> StepInputs:
        t, w, o = shape
        return StepInputs.shapes(t, w, o, self.buckets.rows(t))

    def _logits(self, rows: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((rows, self.vocab), jnp.float32)  # [R, V], as `forward` gives them

    def lower_sample(self, rows: int) -> jax.stages.Lowered:
        logits, slots = self._logits(rows), sample_slots(rows, 0, abstract.full)
        return self._sample.lower(*self._replicated((logits, SamplingInputs.shapes(rows), logits, _shaped(self.last), slots)))

    def lower_penalties(self, rows: int) -> jax.stages.Lowered:
        return self._penalize.lower(*self._replicated((self._logits(rows), PenaltyInputs.shapes(rows, self.vocab))))

    def lower_mask(self, rows: int) -> jax.stages.Lowered:
        bitmask = jax.ShapeDtypeStruct((rows, bitmask_width(self.vocab)), jnp.int32)
        return self._mask.lower(*self._replicated((self._logits(rows), bitmask)))

    def lower_score(self, tokens: int) -> jax.stages.Lowered:
        if self._hidden is None:  # whatever dtype the model's activations have
            _, hidden, _ = jax.eval_shape(partial(forward, self.graph), self.params, self.cache, self._step_inputs(self.buckets.shapes()[0]),
                                          self.last)
            self._hidden = jax.ShapeDtypeStruct(hidden.shape[1:], hidden.dtype)
        inputs = ScoreInputs.shapes(tokens, self.buckets.rows(tokens), self.vocab)
        hidden = jax.ShapeDtypeStruct((tokens, *self._hidden.shape), self._hidden.dtype)
        return self._score.lower(self.graph, _shaped(self.params, self.layout is not None), *self._replicated((hidden, inputs)))

    def stats(self) -> dict[str, int | float]:
        """The fields of protocol.WorkerStats the engine knows, but its facts."""
        stats = {"steps": self.steps, "step_ms": round(self.last_step_ms, 2), "compiled_shapes": self.compiled,
                 "compiles_after_ready": self.compiles_after_ready, **(self.constraints.stats() if self.constraints else {})}
        used = [m["bytes_in_use"] for d in jax.local_devices() if (m := d.memory_stats()) and "bytes_in_use" in m]
        if used:  # the platform reports it (GPU, TPU; not XLA:CPU)
            stats["device_bytes_in_use"] = sum(used)
        return stats

    # Hot weight updates (swap.py): stage new weights beside the live ones, then swap them in whole
    # between steps. A new State of the same tree, shapes, dtypes and shardings: nothing recompiles.

    def stage_disk(self, path: str, load_format: str | None = None) -> int:
        """Stage every parameter from a checkpoint of the serving model: a Hugging Face directory, a
        .gguf file or `package:<module>`; load_format None/"auto", "safetensors" or "gguf". Returns
        the number of parameters staged; CheckpointError (and nothing staged) when it cannot."""
        return self.swap.stage_disk(self._live(), path, load_format)

    def stage_tensors(self, tensors: Iterable[tuple[str, np.ndarray]]) -> int:
        """Stage tensors by Hugging Face name, in HF layout, any float dtype; callable once per
        bucket before the commit. Returns the number taken; CheckpointError naming the tensor (and
        nothing staged, earlier buckets included) when one is unknown or misshapen."""
        return self.swap.stage_tensors(self._live(), tensors)

    def stage_dummy(self, seed: int) -> int:
        """Stage the random weights worker.weights=dummy starts with (seed worker.seed)."""
        return self.swap.stage_dummy(self._live(), seed)

    def commit_weights(self) -> int:
        """Swap every staged parameter in; returns how many. CheckpointError when none is staged.
        Released weights come back this way (whole: a resume stages every parameter)."""
        self.params, count = self.swap.commit(self.params)
        self.released.discard("weights")
        if self.huge_pages:  # the new buffers (the others are on 2 MB pages already: a check each)
            self.weight_pages = on_huge_pages(self.params)
        return count

    # Memory release (RL colocation): the device buffers go, the process and its executables stay.

    def release(self, tags: set[str]) -> None:
        """Free the device buffers of the weights and/or the KV cache ("weights", "kv_cache"). Their
        shapes, dtypes and shardings stay known: a resume allocates the same, and nothing recompiles."""
        if "weights" in tags:
            self.swap.discard()
            for leaf in jax.tree.leaves(self.params):
                leaf.delete()
        if "kv_cache" in tags:
            for pages in self.cache:
                pages.delete()
            if self.experts is not None:
                self.experts.release()
        self.released |= tags

    def resume_kv_cache(self) -> None:
        """An empty KV cache again (the scheduler emptied its prefix cache when it was released)."""
        if "kv_cache" in self.released:
            self.cache = self._empty_cache()
            if self.experts is not None:
                self.experts.resume()
            self.released.discard("kv_cache")

    def discard_weights(self) -> None:
        self.swap.discard()

    def weight_names(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(Hugging Face name, shape in HF layout, serving dtype) of every tensor the model reads."""
        return self.swap.names(self._live())

    def _live(self) -> nnx.Module:
        return nnx.merge(self.graph, self.params)  # a view: its leaves are the live arrays

    def step(self, step: Step, keep_logits: bool = False) -> StepResult:
        """Run a Step. With keep_logits, `last_logits` holds each sampled row's raw logits [V], in
        result order (for parity tests)."""
        if self.released:
            raise RuntimeError(f"a step while the {' and '.join(sorted(self.released))} memory is released")
        started = time.perf_counter()
        params = self.slot_params.resolve(step)
        self._remember(step, params)
        # The matchers' bookkeeping only in a step where some request is constrained (constrained.py)
        constrained = self.constraints is not None and any(p.constraint is not None for p in params)
        if constrained:
            self.constraints.admit(step, params)
        rids: list[str] = []
        sampled, scored, routed = [], [], []  # (sub-step, its executable's outputs, ...)
        wanted = {} if self.experts is None else self.experts.wanted(params)
        prefixes = self.experts.prefixes(step, wanted) if wanted else []
        self.last_shapes = []
        for sub in self.packer.pack(step, params, self.history):
            self.last_shapes.append(sub.shape)
            run = self._executable(self.forwards, sub.shape, self.lower_forward)
            if self.experts is None:
                logits, hidden, self.cache = run(self.params, self.cache, sub.inputs, self.last)
            else:
                logits, hidden, self.cache, self.experts.buffer, chosen = run(self.params, self.cache, sub.inputs, self.last, self.experts.buffer)
                routed += [(sub.inputs, chosen)] if wanted else []
            if sub.score is not None:
                scored.append((sub, self._run_score(sub, hidden)))
            if sub.rids:
                rids += sub.rids
                masks = self._masks(step, params, sub) if constrained else None
                sampled.append((sub, self._run_sample(sub, logits, masks), logits if keep_logits else None))
        result = self._result(step, params, rids, sampled, scored)
        if constrained:
            self._advance_constraints(step, params, sampled, result)
        if wanted:  # only then anything comes back
            result = msgspec.structs.replace(result, experts=self.experts.rows(step, wanted, prefixes, routed))
        self._remember_sampled(step, params, result)
        self.steps += 1
        self.last_step_ms = (time.perf_counter() - started) * 1000
        return msgspec.structs.replace(result, step_ms=self.last_step_ms)

    def _run_score(self, sub: SubStep, hidden: jax.Array) -> tuple[jax.Array, ...]:
        tokens = sub.shape[0]
        inputs = self._absent_as_zeros(sub.score, ScoreInputs.shapes(tokens, self.buckets.rows(tokens), self.vocab))
        return self._executable(self.scorers, tokens, self.lower_score)(self.params, hidden, inputs)

    def _masks(self, step: Step, params: list[SamplingParams], sub: SubStep) -> np.ndarray | None:
        """The constrained rows' token masks (constrained.py), computed while the forward pass the
        sub-step just dispatched runs; None when no row of the sub-step is constrained."""
        rows = len(sub.sampling.seed)
        masks = self.constraints.masks([step.seqs[i] for i in sub.sampled], [params[i] for i in sub.sampled], rows)
        if masks is None:
            return None
        masks, ending = masks
        sub.sampling.banned[ending] = NO_TOKEN  # min_tokens' ban would leave them no token (constrained.py)
        return masks

    def _advance_constraints(self, step: Step, params: list[SamplingParams], sampled: list, result: StepResult) -> None:
        token_of = dict(zip(result.rids, result.token_ids))
        for sub, _, _ in sampled:
            seqs = [step.seqs[i] for i in sub.sampled]
            self.constraints.sampled(seqs, [params[i] for i in sub.sampled], [token_of[seq.rid] for seq in seqs])

    def _run_sample(self, sub: SubStep, logits: jax.Array, masks: np.ndarray | None = None) -> Sampled:
        rows = len(sub.sampling.seed)
        processed = logits
        if sub.penalties is not None:
            p = self._absent_as_zeros(sub.penalties, PenaltyInputs.shapes(rows, self.vocab))
            processed = self._executable(self.penalizers, rows, self.lower_penalties)(logits, p)
        if masks is not None:
            processed = self._executable(self.maskers, rows, self.lower_mask)(processed, masks)
        out, self.last = self._executable(self.samplers, rows, self.lower_sample)(processed, sub.sampling, logits, self.last,
                                                                                   sub.sample_slot)
        return out

    def _remember(self, step: Step, params: list[SamplingParams]) -> None:
        """Feed the penalties' token history with what this Step feeds (history.py), after the
        prefix a cache hit skipped, when the Step brings it."""
        tokens = None
        for seq, s in zip(step.seqs, params):
            if s.uses_penalty() and not seq.follows:  # a follower's token came with the last result
                tokens = from_wire(step.tokens) if tokens is None else tokens
                if seq.history is not None:
                    self.history.feed(seq.rid, 0, from_wire(seq.history), seq.prompt_len)
                self.history.feed(seq.rid, first_position(seq), tokens[seq.start : seq.start + seq.num_tokens], seq.prompt_len)

    def _remember_sampled(self, step: Step, params: list[SamplingParams], result: StepResult) -> None:
        """Feed the history each penalized row's sampled token, at the position the next step feeds it:
        a seq that follows brings no token of its own (and one that does brings the same). A draft's
        verified tokens replace its draft from the position after its first token on."""
        penalized = [seq for seq, s in zip(step.seqs, params) if seq.sample and s.uses_penalty()]
        tokens_of: dict[str, list[int]] = {}
        for rid, token in zip(result.rids, result.token_ids) if penalized else ():
            tokens_of.setdefault(rid, []).append(token)
        for seq in penalized:
            self.history.feed(seq.rid, seq.context_len - seq.drafts, np.array(tokens_of[seq.rid], np.int32), seq.prompt_len)

    def _result(self, step: Step, params: list[SamplingParams], rids: list[str], sampled: list, scored: list) -> StepResult:
        """Read back what the step's executables computed, as one StepResult."""
        token_ids: list[int] = []
        lps: list[float] = []
        tops: list[tuple[np.ndarray, np.ndarray]] = []
        kept: list[np.ndarray] = []
        n_top = min(max((params[i].top_logprobs for sub, _, _ in sampled for i in sub.sampled), default=0), top_count(self.vocab))
        n_ids = max((len(params[i].token_ids_logprob) for sub, _, _ in sampled for i in sub.sampled), default=0)
        ids_lps: list[np.ndarray] = []
        for sub, out, logits in sampled:
            n = len(sub.rids)
            token_ids += np.asarray(out.tokens)[:n].tolist()
            lps += np.asarray(out.logprobs)[:n].tolist()
            if n_top:
                tops.append((np.asarray(out.top_ids)[:n, :n_top], np.asarray(out.top_logprobs)[:n, :n_top]))
            if n_ids:  # read back only when some row asked
                ids_lps.append(np.asarray(out.ids_logprobs)[:n, :n_ids])
            if logits is not None:
                kept += list(np.asarray(logits)[:n])
        # A draft's rows past its first differing token are not the request's (drafts.py)
        keep = kept_rows(step, [i for sub, _, _ in sampled for i in sub.sampled], np.asarray(token_ids))
        if keep is None:
            keep = slice(None)
        else:
            rids, token_ids, lps = (np.asarray(x)[keep].tolist() for x in (rids, token_ids, lps))
            kept = [row for row, k in zip(kept, keep) if k]
        self.last_logits = kept
        top_ids = top_lps = None
        if n_top:
            top_ids = to_wire(np.concatenate([ids for ids, _ in tops])[keep].astype(np.int32))
            top_lps = to_wire(np.concatenate([lp for _, lp in tops])[keep].astype(np.float32))
        ids = to_wire(np.concatenate(ids_lps)[keep].astype(np.float32)) if n_ids else None
        return StepResult(step.step_id, tuple(rids), tuple(token_ids), tuple(lps), 0.0, top_ids, top_lps, prompt_scores(step, params, scored, self.vocab),
                          ids_logprobs=ids)

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

    @staticmethod
    def _executable(table: dict, key: Any, lower: Any) -> Any:
        # Without compile_all (a test of a few shapes) a shape compiles on first use; the compile
        # counter makes that visible, and the serving worker always calls compile_all first.
        if key not in table:
            table[key] = lower(key).compile()
        return table[key]
