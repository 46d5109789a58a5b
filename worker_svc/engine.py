"""The JAX engine: parameters and the paged KV cache on the device, compiled steps per bucket.

`step` is the whole hot path: pack the Step into sub-steps (batch.py), run each, read back. Per sub-step:
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
tokens at least as likely, itself included), position 0 rank 0. The alternatives come at a fixed
width (MAX_TOP_LOGPROBS); with server.max_logprobs past it, a step where some request asks for more
runs its sampling and prompt scoring in the wide executables instead (`_wide`).

Each part is an executable of its own, per bucket (executables.py); the read-back is readback.py's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

import jax
import msgspec
import numpy as np
from flax import nnx

from jaxstream.arrays import from_wire
from jaxstream.config.worker import LoraConfig
from jaxstream.protocol import MAX_TOP_LOGPROBS, ModelFacts, SamplingParams, Step, StepResult
from worker_svc.adapters import AdapterSlots, peft_adapter, projections
from worker_svc.batch import Buckets, StepPacker, SubStep
from worker_svc.constrained import Constraints
from worker_svc.executables import Executables
from worker_svc.history import MIN_CAPACITY, TokenHistory
from worker_svc.huge_pages import HugePages, on_huge_pages
from worker_svc.layers.paged import storage_dtype
from worker_svc.layers.sampling import NO_TOKEN, top_count
from worker_svc.positions import first_position
from worker_svc.readback import Outputs, read_back
from worker_svc.routed import ExpertsCapture
from worker_svc.slots import SlotParams
from worker_svc.sharding import CACHE_AXES, Layout, lora_shardings, place_params
from worker_svc.swap import WeightSwap

log = logging.getLogger("worker")


class Engine:
    def __init__(self, model: nnx.Module, buckets: Buckets, page_size: int, num_pages: int, salt: int = 0,
                 facts: dict[str, str] | None = None, layout: Layout | None = None, routed_experts: bool = False,
                 constraints: Constraints | None = None, kv_cache_dtype: str = "auto", huge_pages: bool = True,
                 max_logprobs: int = MAX_TOP_LOGPROBS, lora: LoraConfig | None = None, state_snapshots: int = 0) -> None:
        """`layout` (sharding.py): the device mesh and logical rules to place the parameters and
        the KV cache with; None keeps everything on the default device, unannotated.
        `routed_experts` (worker.enable_return_routed_experts): capture them (routed.py), when the
        model has MoE layers. `constraints` (constrained.py): the matchers of constrained requests,
        over the model's tokenizer; None: a constrained request is sampled unconstrained (tests
        of other parts). `kv_cache_dtype` (worker.kv_cache_dtype): what the KV cache holds
        (layers/paged.py, `storage_dtype`). `huge_pages` (worker.huge_pages): the weights' CPU
        buffers asked onto 2 MB pages, again after each weight update (huge_pages.py);
        `weight_pages` says what the last asking did. `max_logprobs` (server.max_logprobs): the
        most alternatives a request may ask (executables.py compiles the wide ones past the fixed width).
        `lora` (worker.lora): adapter slots (adapters.py) when it has some; None or 0 slots: none, nothing of them compiled.
        `state_snapshots` (jaxstream/kv_memory.py's `state_snapshots`): a hybrid's state rows kept
        for the prefix cache after the request slots (layers/paged.py)."""
        cfg = model.cfg
        moe_layers = len(getattr(cfg, "moe_layers", ()))
        # What the model is (architectures, model_type; what a request for routed experts needs), reported with the stats
        self.facts = ModelFacts(**(facts or {}), moe_layers=moe_layers, num_hidden_layers=cfg.layers,
                                num_experts_per_tok=getattr(cfg, "top_k", 0), enable_return_routed_experts=routed_experts)
        self.graph, self.params = nnx.split(model)
        self.vocab = cfg.vocab
        # The cache's layout is the model's (layers/paged.py's CacheSpec), its storage from the model
        # dtype (the table's may be int8: quantized.py)
        model_dtype = model.norm.scale[...].dtype
        dtype = self.cache_dtype = storage_dtype(model_dtype, kv_cache_dtype)
        self.cache_spec = model.cache_spec()
        # each [L, P, Z, *per token]; a linear layer's state [L', B + S, *per slot], one row per request slot, then per snapshot
        shapes = self.cache_spec.shapes(cfg.layers, num_pages, page_size, buckets.max_rows + state_snapshots)
        self.layout = layout
        on = None
        if layout is not None:
            place_params(self.params, layout)
            on = {a.name: layout.sharding((*CACHE_AXES, *a.names), shapes[a.name], f"the KV cache's {a.name} [L, P, Z, ...]")
                  for a in self.cache_spec.paged} | {
                  a.name: layout.sharding((None, None, *(a.names or (None,) * len(a.per_slot))), shapes[a.name],
                                          f"the state {a.name} [L', B, ...]") for a in self.cache_spec.states}
        self.huge_pages = huge_pages
        self.weight_pages = on_huge_pages(self.params) if huge_pages else HugePages()
        self.released: set[str] = set()  # memory given back (release): no step runs until resumed
        # [B] the token each slot's row sampled last (StepSeq.slot, < the scheduler's max running requests)
        self.last = jax.device_put(np.zeros(buckets.max_rows, np.int32), None if layout is None else layout.replicated)
        if cfg.numerics.batch_invariant:  # its attention (ordered_attention) reads pairs only
            buckets = dataclasses.replace(buckets, page_list_tokens=0)
        standard = self.cache_spec.per_head
        if not standard and cfg.numerics.kernels is not None:
            log.info("the CPU attention kernel reads keys and values per KV head, not this model's latent cache: "
                     "its attention runs in jax.numpy")
        attends = standard and cfg.numerics.kernel_attends(model_dtype, dtype, cfg.heads // cfg.kv_heads, cfg.head_dim)
        buckets = buckets.choose_page_lists(attends)
        self.buckets = buckets
        # The prefix cache's state rows (the scheduler keeps their bookkeeping); None: the model keeps no state
        self.state_snapshots = state_snapshots if self.cache_spec.states else None
        self.packer = StepPacker(buckets, page_size, num_pages, salt, cfg.vocab, every_page=cfg.numerics.batch_invariant,
                                 snapshots=self.state_snapshots or 0)
        self.history = TokenHistory(max(MIN_CAPACITY, 4 * buckets.max_rows))
        self.slot_params = SlotParams()
        self.experts = None  # the routed experts capture (routed.py), with the switch on and MoE layers
        if routed_experts and moe_layers:
            self.experts = ExpertsCapture(cfg.layers, cfg.top_k, num_pages * page_size, page_size, buckets.tokens[-1],
                                          None if layout is None else layout.replicated)  # [Y, L, k], replicated
        self.constraints = constraints
        # Adapter slots (adapters.py; each request's slot comes with its sampling, StepSeq.adapter); None: the base model alone
        self.adapters = None
        if lora is not None and lora.max_adapters:  # under a layout their arrays split as their base weights (sharding.py)
            found = projections(model)
            split = None if layout is None else lora_shardings(model, layout, {t: din for t, (din, _, _) in found.items()})
            self.adapters = AdapterSlots(found, cfg.layers, lora.max_adapters, lora.max_rank, tuple(lora.target_modules),
                                         model_dtype, None if layout is None else layout.replicated, split)
        self.executables = Executables(self.graph, self.params, self.last, self.cache_spec.cache(shapes), dtype,
                                       None if on is None else self.cache_spec.cache(on), buckets, cfg.numerics, cfg.vocab,
                                       layout, self.experts, masks=constraints is not None, max_logprobs=max_logprobs,
                                       lora=self.adapters)
        self.cache = self.executables.empty_cache()
        self.steps = 0
        self.last_step_ms = 0.0
        self.last_shapes: list[tuple[int, int, int]] = []  # the last step's compiled shapes, one per sub-step
        self.last_logits: list[np.ndarray] = []
        self.swap = WeightSwap(layout)  # a weight update staged beside `params` (swap.py)

    # What the stats report of the compiled steps (executables.py counts them)

    @property
    def compiles_after_ready(self) -> int:
        return self.executables.compiles_after_ready

    @property
    def compiled(self) -> int:
        return self.executables.compiled

    @property
    def kv_bytes_per_token(self) -> int:
        """The KV cache's bytes per token slot, by the spec the cache was allocated from (whatever its kind)."""
        return self.cache_spec.bytes_per_token(self.facts.num_hidden_layers, self.cache_dtype)

    def stats(self) -> dict[str, int | float]:
        """The fields of protocol.WorkerStats the engine knows, but its facts."""
        stats = {"steps": self.steps, "step_ms": round(self.last_step_ms, 2), "compiled_shapes": self.compiled,
                 "kv_bytes_per_token": self.kv_bytes_per_token,
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
        Released weights come back this way, with the update after their resume (whole: the
        worker's control refuses one that leaves a tensor unset)."""
        self.params, count = self.swap.commit(self.params)
        self.released.discard("weights")
        if self.huge_pages:  # the new buffers (the others are on 2 MB pages already: a check each)
            self.weight_pages = on_huge_pages(self.params)
        return count

    # LoRA adapters (adapters.py): written into their slots between steps; no step recompiles.

    def load_adapter(self, slot: int, path: str) -> int:
        """Read the PEFT directory `path` into adapter slot `slot` (ValueError naming what does not fit); its rank."""
        return self._slots().load(slot, path).rank

    def load_adapter_tensors(self, slot: int, config: dict, tensors: list[tuple[str, np.ndarray]]) -> int:
        """Write a pushed adapter (PEFT's LoRA config and its tensors by PEFT's names) into `slot`; its rank."""
        slots = self._slots()
        adapter = peft_adapter(config, dict(tensors), slots.found, slots.max_rank, slots.targets, "the pushed adapter", slots.layers)
        return slots.load(slot, adapter).rank

    def _slots(self) -> AdapterSlots:
        if self.adapters is None:
            raise ValueError("no adapter slots: worker.lora.max_adapters is 0")
        return self.adapters

    def _with_adapters(self, inputs):
        """The sub-step's inputs with the adapters' arrays and each token's slot (its row's, by ctx.segment)."""
        rows = np.array(self.slot_params.adapters + [-1], np.int32)  # each seq's (StepSeq.adapter, kept by slot); [-1]: padding
        return inputs._replace(ctx=inputs.ctx._replace(lora=self.adapters.step(rows[inputs.ctx.segment])))

    # Memory release (RL colocation): the device buffers go, the process and its executables stay.

    def release(self, tags: set[str]) -> None:
        """Free the device buffers of the weights and/or the KV cache ("weights", "kv_cache"). Their
        shapes, dtypes and shardings stay known: a resume allocates the same, and nothing recompiles."""
        if "weights" in tags:
            self.swap.discard()
            for leaf in jax.tree.leaves(self.params):
                leaf.delete()
        if "kv_cache" in tags:
            for pages in jax.tree.leaves(self.cache):
                pages.delete()
            if self.experts is not None:
                self.experts.release()
        self.released |= tags

    def resume_kv_cache(self) -> None:
        """An empty KV cache again (the scheduler emptied its prefix cache when it was released)."""
        if "kv_cache" in self.released:
            self.cache = self.executables.empty_cache()
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
        """Run a Step: pack it into sub-steps, run each one's executables, read back one StepResult.
        With keep_logits, `last_logits` holds each sampled row's raw logits [V], in result order (for
        parity tests)."""
        if self.released:
            raise RuntimeError(f"a step while the {' and '.join(sorted(self.released))} memory is released")
        started = time.perf_counter()
        params, constrained = self._admit(step)
        subs = self.packer.pack(step, params, self.history)
        outputs = self._run(step, params, subs, constrained, keep_logits)
        result = self._read_back(step, params, outputs, constrained)
        self.steps += 1
        self.last_step_ms = (time.perf_counter() - started) * 1000
        return msgspec.structs.replace(result, step_ms=self.last_step_ms)

    def _admit(self, step: Step) -> tuple[list[SamplingParams], bool]:
        """Each seq's SamplingParams (slots.py), the penalties' history fed with what the Step feeds,
        and whether some request is constrained (its matchers admitted: only then any bookkeeping)."""
        params = self.slot_params.resolve(step)
        self._remember(step, params)
        constrained = self.constraints is not None and any(p.constraint is not None for p in params)
        if constrained:
            self.constraints.admit(step, params)
        return params, constrained

    def _run(self, step: Step, params: list[SamplingParams], subs: list[SubStep], constrained: bool,
             keep_logits: bool) -> Outputs:
        """Dispatch each sub-step's forward pass, prompt scores and sampling; nothing is read back here."""
        outputs = Outputs()
        sample_wide, score_wide = self._wide(step, params)
        if sample_wide:
            outputs.top_width = self.executables.wide
        if score_wide:
            outputs.score_width = self.executables.wide
        if self.experts is not None and (wanted := self.experts.wanted(params)):
            outputs.wanted, outputs.prefixes = wanted, self.experts.prefixes(step, wanted)
        self.last_shapes = []
        for sub in subs:
            self.last_shapes.append(sub.shape)
            run = self.executables.forward(sub.shape)
            if self.adapters is not None:
                sub.inputs = self._with_adapters(sub.inputs)
            if self.experts is None:
                logits, hidden, self.cache = run(self.params, self.cache, sub.inputs, self.last)
            else:
                logits, hidden, self.cache, self.experts.buffer, chosen = run(self.params, self.cache, sub.inputs, self.last, self.experts.buffer)
                outputs.routed += [(sub.inputs, chosen)] if outputs.wanted else []
            if sub.score is not None:
                outputs.scored.append((sub, self.executables.score(self.params, sub, hidden, score_wide)))
            if sub.rids:
                outputs.rids += sub.rids
                masks = self._masks(step, params, sub) if constrained else None
                sampled, self.last = self.executables.sample(sub, logits, self.last, masks, sample_wide)
                outputs.sampled.append((sub, sampled, logits if keep_logits else None))
        return outputs

    def _wide(self, step: Step, params: list[SamplingParams]) -> tuple[bool, bool]:
        """Whether this step samples, and scores prompts, in the wide executables: some seq that
        samples (scores) asks past the fixed width. Never without them (the default config)."""
        if not self.executables.wide:
            return False, False
        fixed = top_count(self.vocab)
        return (any(seq.sample and p.top_logprobs > fixed for seq, p in zip(step.seqs, params)),
                any(seq.score_from >= 0 and p.prompt_alternatives() > fixed for seq, p in zip(step.seqs, params)))

    def _read_back(self, step: Step, params: list[SamplingParams], outputs: Outputs, constrained: bool) -> StepResult:
        """The StepResult (readback.py), and what the next step needs from it on the host: the
        constrained rows' matchers and the penalties' history advanced by the sampled tokens."""
        result, self.last_logits = read_back(step, params, outputs, self.vocab)
        if constrained:
            self._advance_constraints(step, params, outputs.sampled, result)
        if outputs.wanted:  # only then anything comes back
            result = msgspec.structs.replace(result, experts=self.experts.rows(step, outputs.wanted, outputs.prefixes, outputs.routed))
        self._remember_sampled(step, params, result)
        return result

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
