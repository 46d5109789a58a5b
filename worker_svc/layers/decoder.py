"""What every decoder-only model here shares around its decoder layer: the token embedding, the
layers stacked along a leading `layers` axis and run with `jax.lax.scan` (one compiled layer body
serves every depth, so compile time does not grow with the layer count), the final RMSNorm, and
an LM head tied to the embedding or not. A model file defines its layer and passes a maker.

A model whose layers differ in structure (Qwen3-MoE with dense MLP layers among the MoE ones) passes
several makers instead, each with the layer indices it builds: each is a stack of its own, and a step
still runs every layer in index order in one scan, whose body picks the layer's stack by a switch on
per-layer data (its stack, its row there). One scan, because a scan per run of one stack's layers
left a run of one layer unrolled by XLA, and XLA then copied the donated cache every step. Alike
layers (every model so far, as released) are one stack, scanned as it lies.

Gemma's variations are arguments: the embedding scaled by sqrt(dim) (`embed_scale`), the final
norm's (1 + w) (`norm_offset`), the logits soft-capped (`logit_softcap`); a model whose layers rotate
by different bases overrides `rotary` (Gemma 3: layers/rotary.py's LayerRopes, each layer picking
its own inside the scan).

A step of few rows where the model's kernels take the products (Numerics.reads_stacked_whole; on
CPU) leaves the layers' matmul weights out of the scan: the layer body gets each stacked weight
whole with its layer row, and the kernel reads the layer where it lies, where XLA:CPU would slice
it out into a copy first (stack_layer.py).

Shapes in the legend of worker_svc/__init__.py.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.attention import KVCache, PagedContext
from worker_svc.layers.embedding import Embed, LMHead
from worker_svc.layers import states
from worker_svc.layers.stack_layer import StackLayer, in_place_paths
from worker_svc.layers.moe import Routed
from worker_svc.layers.norms import RMSNorm
from worker_svc.layers.paged import CacheSpec
from worker_svc.layers.rotary import Rope
from worker_svc.layers.softmax_state import capped


Maker = Callable[[nnx.Rngs], nnx.Module]


class Decoder(nnx.Module):
    """cfg: vocab, dim, layers, head_dim, rope_theta, rope_scaling, norm_eps, tie_embeddings. make_layer(rngs)
    builds one layer, called as layer(x, rope, cache, index, ctx) -> (x, k, v), or (x, k) for a cache of
    keys alone (`cache_spec`); or `make_layer` is
    {stack name: (maker, the layer indices it builds)}, the indices of all stacks covering 0..L-1 once."""

    def __init__(self, cfg: Any, make_layer: Maker | dict[str, tuple[Maker, Sequence[int]]], *, dtype: jnp.dtype,
                 rngs: nnx.Rngs, embed_scale: float | None = None, norm_offset: float = 0.0,
                 logit_softcap: float | None = None) -> None:
        self.cfg = cfg
        self.embed = Embed(cfg.vocab, cfg.dim, scale=embed_scale, numerics=cfg.numerics, dtype=dtype, rngs=rngs)
        stacks = make_layer if isinstance(make_layer, dict) else {"layers": (make_layer, range(cfg.layers))}
        # (stack name, its layer indices), static: the loader reads which checkpoint layer each row holds.
        self.stack_layers = tuple((name, tuple(ids)) for name, (_, ids) in stacks.items())
        if sorted(i for _, ids in self.stack_layers for i in ids) != list(range(cfg.layers)):
            raise ValueError(f"the stacks' layer indices {self.stack_layers} do not cover 0..{cfg.layers - 1} once")
        for name, (maker, ids) in stacks.items():
            setattr(self, name, _stacked(maker, len(ids), rngs))  # every parameter has a leading [layers in stack] axis
        # Static, per layer in order: (its stack's number in stack_layers, its row in that stack).
        self.layer_rows = tuple(where for _, where in sorted((i, (n, row)) for n, (_, ids) in enumerate(self.stack_layers)
                                                             for row, i in enumerate(ids)))
        self.alike = self.layer_rows == tuple((0, i) for i in range(cfg.layers))  # one stack, in layer order
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, offset=norm_offset, numerics=cfg.numerics, dtype=dtype)
        self.logit_softcap = logit_softcap
        self.lm_head = None if cfg.tie_embeddings else LMHead(cfg.dim, cfg.vocab, numerics=cfg.numerics, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array, ctx: PagedContext, cache: KVCache, sample_at: jax.Array, experts: bool = False,
                 rows: int | None = None):
        """tokens [T] -> (logits [R, V] f32 at the tokens `sample_at` [R], the final normed hidden
        states [T, D] (for `head` to score prompt tokens), a KVCache of the new entries of each paged
        array, keys and values [L, T, K, H] (v None for a cache of keys alone: `cache_spec`), for the
        caller to write into the cache after this read-only pass, and of the per-slot states as this
        step leaves them (whole arrays, None for a model without: `cache_spec`'s states)). With `experts` (static), a fifth:
        the experts each layer routed each token to, [L, T, k] i32 (cfg.top_k), 0 in dense layers. `rows`
        (static): at most this many rows in the step (`trunk`)."""
        x, new, *routed = self.trunk(tokens, ctx, cache, experts, rows)
        h = self.norm(x, jnp.float32 if self.cfg.numerics.lm_head_fp32 else None)  # [T, D]
        return self.head(jnp.take(h, sample_at, axis=0)), h, new, *routed

    def trunk(self, tokens: jax.Array, ctx: PagedContext, cache: KVCache, experts: bool = False,
              rows: int | None = None) -> tuple[jax.Array, ...]:
        """tokens [T] -> (the last layer's output [T, D], before the final norm; a KVCache of keys and
        values [L, T, K, H] (L: the layers holding pages, CacheSpec.paged_layers) and the states as the step leaves them (`__call__`); with `experts`, the
        routed experts [L, T, k]).

        The per-slot states (linear attention's) are the scan's carry beside x, read and written
        around each layer (layers/states.py): a layer of such a model gets its start rows [R, ...] in
        its cache's conv and state (R: `rows`, static, at most this many rows in the step; None: one
        per token) and returns its end rows after its cache entries (x, k, v, conv, state)."""
        rope = self.rotary(ctx.positions)
        x = self.embed(tokens)  # [T, D]
        # In a step of few rows the layers' matmul weights (their IN_PLACE names) are not scanned:
        # each is handed whole with its layer row, for the kernel to read in place (Numerics).
        few = self.cfg.numerics.reads_stacked_whole(tokens.shape[0])
        stacks = [self._split(name, few) for name, _ in self.stack_layers]

        spec = self.cache_spec()
        paged = len(spec.paged)
        # The per-slot states (layers/states.py): each layer's start rows gathered before the switch
        # and its end rows scattered after it, so the carried arrays are no branch's operand (a
        # branch passing them through made XLA copy both whole per layer and step). A layer without
        # states has row L' (out of range): it reads zeros and its writes drop.
        keeps = cache.state is not None
        if keeps:
            state_rows = jnp.asarray([r if r >= 0 else cache.state.shape[0] for r in spec.state_rows(self.cfg.layers)], jnp.int32)
            step = states.step_rows(ctx, tokens.shape[0] if rows is None else rows, cache.state.shape[1])

        def layer(x, starts, index, row, stack, layer_params):  # layer `index`, row `row` of `stack` -> ((x, end rows), (its cache entries, chosen))
            graph, whole, _ = stack
            held = nnx.from_flat_state([(path, var.replace(StackLayer(var.get_raw_value(), row))) for path, var in whole])
            # Under capture, a MoE layer's sown choices are kept only when asked for (Routed).
            module = nnx.merge(graph, layer_params, held)
            view = cache._replace(conv=starts[0], state=starts[1])
            out = nnx.capture(module, *((Routed,) if experts else ()))(x, rope, view, index, ctx)
            # capturing nothing, it returns the layer's output alone: x, an entry per paged array (cache_spec), the end rows
            (x, *entries), *sown = out if experts else (out,)
            ends = tuple(entries[paged:]) or starts
            return (x, ends), (KVCache(*entries[:paged]), _chosen(sown, x.shape[0], self.cfg.top_k) if experts else None)

        def body(run):  # run(x, start rows, xs) -> ((x, end rows), out), xs[0] the layer: the layer, its states around it
            def scanned(carry, xs):
                x, carried = carry
                starts = states.gather(carried, state_rows[xs[0]], step) if keeps else carried
                (x, ends), out = run(x, starts, xs)
                return (x, states.scatter(carried, state_rows[xs[0]], step, ends) if keeps else carried), out
            return scanned

        carry = (x, cache.states)
        if self.alike:  # one stack, row i its layer i: the scan slices each layer's weights
            rows_in = jnp.arange(self.cfg.layers)
            scanned = body(lambda x, starts, s: layer(x, starts, s[0], s[1], stacks[0], s[2]))
            carry, (new, chosen) = jax.lax.scan(scanned, carry, (rows_in, rows_in, stacks[0][2]))
        else:
            # Several stacks: one scan over every layer, whose body runs the layer's stack by a switch
            # (each branch slices its row out of its stack). A scan per run of one stack's layers left a
            # run of one layer unrolled by XLA, its attention reading the cache outside any loop, and
            # XLA copied the donated cache before the in-place write, twice per array and step.
            def branch(x, starts, index, row, stack):
                sliced = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, row, keepdims=False), stack[2])
                return layer(x, starts, index, row, stack, sliced)

            branches = [partial(branch, stack=stack) for stack in stacks]
            which, rows_in = (jnp.asarray(a, jnp.int32) for a in zip(*self.layer_rows))
            scanned = body(lambda x, starts, s: jax.lax.switch(s[1], branches, x, starts, s[0], s[2]))
            carry, (new, chosen) = jax.lax.scan(scanned, carry, (jnp.arange(self.cfg.layers), which, rows_in))
        x, (conv, state) = carry
        if spec.paged_layers is not None:  # a hybrid: only the layers holding pages keep their entries (the others' are zeros)
            new = jax.tree.map(lambda entries: entries[jnp.asarray(spec.paged_layers)], new)
        new = new._replace(conv=conv, state=state)  # k, v [L, T, ...] (v None for a cache of keys alone); the states whole
        return (x, new, chosen) if experts else (x, new)

    def _split(self, name: str, few: bool) -> tuple[nnx.GraphDef, list, nnx.State]:
        """Stack `name` as (its graph, the weights handed whole (flat; `few`: its IN_PLACE ones, else
        none), the rest)."""
        graph, params = nnx.split(getattr(self, name))
        whole = in_place_paths(getattr(self, name)) if few else ()
        flat = nnx.to_flat_state(params)
        held = [(path, var) for path, var in flat if any(path[:len(prefix)] == prefix for prefix in whole)]
        apart = {path for path, _ in held}
        return graph, held, nnx.from_flat_state([(path, var) for path, var in flat if path not in apart])

    def cache_spec(self) -> CacheSpec:
        """The layout of the paged cache this model's layers read and write (layers/paged.py): keys
        and values per KV head; a model whose attention caches otherwise overrides it (DeepSeek's latent)."""
        return CacheSpec.standard(self.cfg.kv_heads, self.cfg.head_dim)

    def rotary(self, positions: jax.Array) -> Rope:
        """The step's rotary for tokens at `positions` [T], computed once and handed to every layer."""
        return Rope(positions, self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)

    def head(self, h: jax.Array) -> jax.Array:
        """Final normed hidden states [R, D] -> logits [R, V] f32 (soft-capped where the model caps them)."""
        return capped(self.embed.attend(h) if self.lm_head is None else self.lm_head(h), self.logit_softcap)


def _chosen(sown: list[nnx.State], tokens: int, top_k: int) -> jax.Array:
    """The experts a layer's MoE sowed this call ([T, k] i32; layers/moe.py's Routed), or zeros for a
    layer without one: SGLang's rule for dense layers (its buffer stays 0 where no MoE writes)."""
    chosen = jax.tree.leaves(sown)
    return chosen[0] if chosen else jnp.zeros((tokens, top_k), jnp.int32)


def _stacked(make_layer: Maker, count: int, rngs: nnx.Rngs) -> nnx.Module:
    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def stacked(rngs: nnx.Rngs) -> nnx.Module:
        return make_layer(rngs)

    return stacked(rngs)

