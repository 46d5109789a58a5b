"""What every decoder-only model here shares around its decoder layer: the token embedding, the
layers stacked along a leading `layers` axis and run with `jax.lax.scan` (one compiled layer body
serves every depth, so compile time does not grow with the layer count), the final RMSNorm, and
an LM head tied to the embedding or not. A model file defines its layer and passes a maker.

A model whose layers differ in structure (Qwen3-MoE with dense MLP layers among the MoE ones) passes
several makers instead, each with the layer indices it builds: each is a stack of its own, and a step
runs the layers in index order, one scan per run of consecutive layers from the same stack. Alike
layers (every model so far, as released) are one stack and one scan.

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

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.attention import KVCache, PagedContext
from worker_svc.layers.embedding import Embed, LMHead
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
        self.runs = _runs(self.stack_layers)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, offset=norm_offset, numerics=cfg.numerics, dtype=dtype)
        self.logit_softcap = logit_softcap
        self.lm_head = None if cfg.tie_embeddings else LMHead(cfg.dim, cfg.vocab, numerics=cfg.numerics, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array, ctx: PagedContext, cache: KVCache, sample_at: jax.Array, experts: bool = False):
        """tokens [T] -> (logits [R, V] f32 at the tokens `sample_at` [R], the final normed hidden
        states [T, D] (for `head` to score prompt tokens), the new entries of each cache array, keys
        and values [L, T, K, H] (v None for a cache of keys alone: `cache_spec`), for the caller to
        write into the cache after this read-only pass). With `experts` (static), a fifth:
        the experts each layer routed each token to, [L, T, k] i32 (cfg.top_k), 0 in dense layers."""
        x, k, v, *routed = self.trunk(tokens, ctx, cache, experts)
        h = self.norm(x, jnp.float32 if self.cfg.numerics.lm_head_fp32 else None)  # [T, D]
        return self.head(jnp.take(h, sample_at, axis=0)), h, k, v, *routed

    def trunk(self, tokens: jax.Array, ctx: PagedContext, cache: KVCache, experts: bool = False) -> tuple[jax.Array, ...]:
        """tokens [T] -> (the last layer's output [T, D], before the final norm; keys and values [L, T, K, H];
        with `experts`, the routed experts [L, T, k])."""
        rope = self.rotary(ctx.positions)
        x = self.embed(tokens)  # [T, D]
        written, routed = [], []  # per run: its layers' new cache entries (KVCache), routed experts
        for name, start, stop, first in self.runs:  # in layer order
            graph, params = nnx.split(getattr(self, name))
            # In a step of few rows the layers' matmul weights (their IN_PLACE names) are not scanned:
            # each is handed whole with its layer row, for the kernel to read in place (Numerics).
            whole = in_place_paths(getattr(self, name)) if self.cfg.numerics.reads_stacked_whole(tokens.shape[0]) else ()
            flat = nnx.to_flat_state(params)
            stacked = [(path, var) for path, var in flat if any(path[:len(prefix)] == prefix for prefix in whole)]
            apart = {path for path, _ in stacked}
            params = nnx.from_flat_state([(path, var) for path, var in flat if path not in apart])
            if stop - start < len(dict(self.stack_layers)[name]):  # part of the stack: its rows start:stop
                params = jax.tree.map(lambda a: a[start:stop], params)

            def body(x, scanned, graph=graph, stacked=stacked, start=start):
                index, row, layer_params = scanned
                layer = nnx.from_flat_state([(path, var.replace(StackLayer(var.get_raw_value(), start + row)))
                                             for path, var in stacked])
                # Under capture, a MoE layer's sown choices are kept only when asked for (Routed).
                module = nnx.merge(graph, layer_params, layer)
                out = nnx.capture(module, *((Routed,) if experts else ()))(x, rope, cache, index, ctx)
                # capturing nothing, it returns the layer's output alone: x and an entry per cache array (cache_spec)
                (x, *entries), *sown = out if experts else (out,)
                return x, (KVCache(*entries), _chosen(sown, x.shape[0], self.cfg.top_k) if experts else None)

            rows = jnp.arange(stop - start)
            x, (new, chosen) = jax.lax.scan(body, x, (first + rows, rows, params))
            written.append(new)
            routed.append(chosen)
        k, v = written[0] if len(written) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *written)
        if experts:
            return x, k, v, routed[0] if len(routed) == 1 else jnp.concatenate(routed)
        return x, k, v

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


def _runs(stack_layers: tuple[tuple[str, tuple[int, ...]], ...]) -> tuple[tuple[str, int, int, int], ...]:
    """Maximal runs of consecutive layers held by one stack, in layer order: (stack name, first and
    end row in the stack, first layer index). E.g. stacks a: (0, 2, 3), b: (1,) ->
    (a, 0, 1, 0), (b, 0, 1, 1), (a, 1, 3, 2)."""
    where = {i: (name, row) for name, ids in stack_layers for row, i in enumerate(ids)}
    runs: list[tuple[str, int, int, int]] = []
    for i in sorted(where):
        name, row = where[i]
        if runs and runs[-1][0] == name and runs[-1][2] == row:
            runs[-1] = (name, runs[-1][1], row + 1, runs[-1][3])
        else:
            runs.append((name, row, row + 1, i))
    return tuple(runs)
