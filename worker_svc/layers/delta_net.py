"""Gated DeltaNet (Yang et al., 2024), the linear attention of Qwen3-Next and Qwen3.5, as
transformers' Qwen3_5GatedDeltaNet computes it: a projection to queries, keys and values that a short
causal depthwise convolution (width W, SiLU) mixes over the last W tokens; per value head a decay
g = -exp(A_log) * softplus(a + dt_bias) and a write strength beta = sigmoid(b); queries and keys
L2-normalized, queries scaled by Dk**-0.5, the key heads repeated over the value heads they serve;
then the gated delta rule over a [Dk, Dv] matrix S per value head, token after token:

    S <- S * exp(g);   S <- S + k (beta (v - S^T k))^T;   out = S^T q

and the output RMS-normalized per head, times SiLU of a gate z, projected back to the model width.

What a request keeps between steps is not an entry per token but two fixed-size states per layer
(layers/paged.py's CacheSpec.states): the last W - 1 convolution inputs ("conv", [W - 1, Nk, G]) and S
("state", [N, Dk, Dv]), one row per request slot. A step packs several rows (prefill chunks and
decodes); each row's tokens are contiguous and in position order (batch.py), so a token's earlier
convolution inputs are its row's earlier tokens in this step, then the row's saved window; and the
delta rule runs in chunks of up to CHUNK tokens (`_delta_rule`: the chunked form transformers and
flash-linear-attention use, one `lax.scan` step per chunk), each row starting from its saved state
at its first token (from zeros at position 0: a (re)admitted request needs no clearing) and saving
it at its last. The layer sees only its rows' states: the decoder hands it each row's start states
[R, ...] and writes the end states it returns into the slots (layers/states.py: the state arrays
themselves never pass through a layer). A chunked prefill thus carries both states from chunk to
chunk; a decode step is the same code over one token per row. A prefix cache hit starts a row from
a snapshot row instead of its slot, and a chunk ending at a kept page boundary saves its states into
a snapshot row as well (PagedContext.state_from and state_save; scheduler_svc/snapshots.py). Under batch_invariant the chunks' boundaries, which follow the
step's packing, would move a token's summation order: the rule runs token by token instead
(`_delta_rule_by_token`), and every sum along a row in tiles (numerics.py).

Under tensor parallelism the layer splits by head as attention does (`GatedDeltaNet.__init__`): a
shard holds whole key heads with the value heads they serve, their convolution channels and their
rows of both states, so nothing crosses shards before the output projection's reduction.

Shapes in the legend of worker_svc/__init__.py; here Nk key heads, r = N / Nk value heads per key
head, G = 2 Dk + r Dv a key head's convolution channels (its query, key, then its value heads' values).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from worker_svc.layers.numerics import Numerics
from worker_svc.layers.paged import KVCache, PagedContext, StateArray
from worker_svc.layers.quantized import weight
from worker_svc.layers.states import TokenRows, token_rows


def delta_states(layers: int, width: int, key_heads: int, heads: int, key_dim: int, value_dim: int) -> tuple[StateArray, ...]:
    """The per-slot arrays of `layers` linear layers (CacheSpec.states), split by head as the weights are."""
    group = 2 * key_dim + heads // key_heads * value_dim
    return (StateArray("conv", layers, (width - 1, key_heads, group), (None, "kv_heads", None)),
            StateArray("state", layers, (heads, key_dim, value_dim), ("heads", None, None)))


class GatedDeltaNet(nnx.Module):
    """One linear-attention layer."""

    def __init__(self, dim: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int, conv_width: int,
                 norm_eps: float, *, fused: bool = False, numerics: Numerics = Numerics(),
                 dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        """Every weight is laid out by head so that tensor parallelism splits the layer by head as
        it splits attention: the convolution's channels grouped by key head ([Nk, G], G = 2 Dk + r Dv:
        the head's query, key, then the values of the r = N / Nk value heads it serves), split by
        `kv_heads`; the per-value-head ones split by `heads` (a key head's value heads are consecutive,
        so a shard holds a key head and its value heads together); the output projection's partial
        sums reduce as o_proj's do. `fused` (Qwen3-Next): the input projections as its checkpoint
        holds them, already grouped by key head, `qkvz` [D, Nk, G + r Dv] and `ba` [D, Nk, 2 r]; else
        (Qwen3.5) `qkv` [D, Nk, G] (in_proj_qkv regrouped on reading), `z` [D, N, Dv], `b` and `a` [D, N]."""
        self.numerics, self.eps = numerics, norm_eps
        self.key_heads, self.value_heads, self.key_dim, self.value_dim = key_heads, value_heads, key_dim, value_dim
        int8, std, r = numerics.quantization, dim**-0.5, value_heads // key_heads
        group = 2 * key_dim + r * value_dim  # G
        self.fused = fused
        if fused:
            self.qkvz = weight(rngs, (dim, key_heads, group + r * value_dim), std, ("embed", "kv_heads", None), (0,), dtype, int8)
            self.ba = weight(rngs, (dim, key_heads, 2 * r), std, ("embed", "kv_heads", None), (0,), dtype, None)
        else:
            self.qkv = weight(rngs, (dim, key_heads, group), std, ("embed", "kv_heads", None), (0,), dtype, int8)  # [D, Nk, G]
            self.z = weight(rngs, (dim, value_heads, value_dim), std, ("embed", "heads", None), (0,), dtype, int8)  # [D, N, Dv]
            self.b = weight(rngs, (dim, value_heads), std, ("embed", "heads"), (0,), dtype, None)  # [D, N]
            self.a = weight(rngs, (dim, value_heads), std, ("embed", "heads"), (0,), dtype, None)  # [D, N]
        self.conv = _param(jax.random.normal(rngs.params(), (conv_width, key_heads, group)) * conv_width**-0.5, dtype,
                           (None, "kv_heads", None))  # [W, Nk, G]
        self.dt_bias = _param(jnp.ones((value_heads,)), dtype, ("heads",))  # [N]
        self.A_log = _param(jnp.log(jnp.linspace(1.0, 16.0, value_heads)), dtype, ("heads",))  # [N]
        self.norm = _param(jnp.ones((value_dim,)), dtype, (None,))  # [Dv]: the output norm's scale, shared by the heads
        self.out = weight(rngs, (value_heads, value_dim, dim), (value_heads * value_dim)**-0.5, ("heads", None, "embed"), (0, 1),
                          dtype, int8)  # [N, Dv, D]

    def __call__(self, x: jax.Array, cache: KVCache, layer: jax.Array, ctx: PagedContext) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [T, D], cache.conv [R, W - 1, Nk, G] and cache.state [R, N, Dk, Dv] each row's start states
        (zeros for a fresh row: layers/states.py) -> (output [T, D], each row's end states, shaped alike)."""
        T, N, Dk, Dv = x.shape[0], self.value_heads, self.key_dim, self.value_dim
        mixed, z, b, a = self._project(x)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))

        rows = token_rows(ctx.segment)
        mixed, window = _convolve(mixed.astype(jnp.float32), self.conv[...].astype(jnp.float32), cache.conv, rows,
                                  self.numerics.rowwise)
        conv = _ends(cache.conv, rows, window)  # a row's window after its last token

        q, k = self.numerics.rowwise(lambda m: (_l2norm(m[..., :Dk]), _l2norm(m[..., Dk:2 * Dk])), mixed)  # [T, Nk, Dk]
        v = mixed[..., 2 * Dk:].reshape(T, N, Dv)
        repeat = N // self.key_heads  # each key head serves this many consecutive value heads
        q, k = jnp.repeat(q, repeat, axis=1) * Dk**-0.5, jnp.repeat(k, repeat, axis=1)
        rule = _delta_rule_by_token if self.numerics.batch_invariant else _delta_rule
        out, state = rule(q, k, v, g, beta, cache.state.astype(jnp.float32), ctx.segment, rows)

        normed = self.numerics.rowwise(lambda o: o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + self.eps), out)
        gated = (normed.astype(x.dtype) * self.norm[...]).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        y = self.numerics.matmul("TNV,NVD->TD", gated.astype(x.dtype), self.out[...])
        return y, conv, state

    def _project(self, x: jax.Array) -> tuple[jax.Array, ...]:
        """x [T, D] -> (the convolution's inputs [T, Nk, G]: per key head its query, key and values;
        the gate z [T, N, Dv]; b and a [T, N])."""
        matmul, T, N, Dv = self.numerics.matmul, x.shape[0], self.value_heads, self.value_dim
        if not self.fused:
            return (matmul("TD,DKG->TKG", x, self.qkv[...]), matmul("TD,DNV->TNV", x, self.z[...]),
                    matmul("TD,DN->TN", x, self.b[...]), matmul("TD,DN->TN", x, self.a[...]))
        r, G = N // self.key_heads, 2 * self.key_dim + N // self.key_heads * Dv
        y = matmul("TD,DKW->TKW", x, self.qkvz[...])  # per key head: q, k, its r value heads' v, then their z
        ba = matmul("TD,DKW->TKW", x, self.ba[...])
        return y[..., :G], y[..., G:].reshape(T, N, Dv), ba[..., :r].reshape(T, N), ba[..., r:].reshape(T, N)


def _param(value: jax.Array, dtype: jnp.dtype, names: tuple[str | None, ...]) -> nnx.Param:
    return nnx.Param(value.astype(dtype), out_sharding=names, eager_sharding=False)


def _ends(starts: jax.Array, rows: TokenRows, after: jax.Array) -> jax.Array:
    """starts [R, ...] with each row's entry replaced by `after` [T, ...] at its last token (a row
    numbered past R, padding, dropped)."""
    return starts.at[jnp.where(rows.last, rows.row, starts.shape[0])].set(after, mode="drop")


def _l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _convolve(mixed: jax.Array, w: jax.Array, starts: jax.Array, rows: TokenRows, rowwise: Callable) -> tuple[jax.Array, jax.Array]:
    """The causal depthwise convolution of mixed [T, Nk, G] with w [W, Nk, G], then SiLU, each token
    over its row's last W inputs: earlier tokens of its row in this step, before them its row's start
    window (starts [R, W - 1, Nk, G]; zeros for a fresh row). Returns (the outputs [T, Nk, G], each
    token's window of its last W - 1 inputs [T, W - 1, Nk, G]: its row's window after it). `rowwise`
    (Numerics'): each token's sum over its own taps, in tiles under batch_invariant."""
    width, first = w.shape[0], rows.first
    saved = starts.at[rows.row].get(mode="fill", fill_value=0.0)  # [T, W - 1, Nk, G]
    index = jnp.arange(mixed.shape[0])
    taps = []
    for back in range(width - 1, -1, -1):  # tap W-1-back reads the input `back` tokens earlier
        earlier = index - back
        inside = earlier >= first
        from_saved = saved[index, jnp.clip(width - 1 - (first - earlier), 0, width - 2)]
        taps.append(jnp.where(inside[:, None, None], mixed[jnp.clip(earlier, 0)], from_saved))
    taps = jnp.stack(taps, axis=1)  # [T, W, Nk, G]
    return rowwise(lambda t: jax.nn.silu(jnp.einsum("TWKG,WKG->TKG", t, w)), taps), taps[:, 1:]


CHUNK = 16  # tokens per chunk of the delta rule (at most): its per-token states are CHUNK x [N, Dk, Dv]


def _delta_rule(q, k, v, g, beta, starts, segment, rows):
    """The gated delta rule over the step's tokens in chunks (transformers' chunked form, Yang et al.
    2024's WY representation), one `lax.scan` step per chunk of C tokens: within a chunk every token
    of a row sees its row's state at the chunk's start and the row's earlier tokens in the chunk,
    through a triangular solve; the state a row leaves is then its start state decayed plus the
    chunk's writes. q, k [T, N, Dk], v [T, N, Dv], g, beta [T, N] (float32), starts [R, N, Dk, Dv]
    each row's start state (zeros for a fresh row), rows (layers/states.py's TokenRows). Returns
    (the outputs [T, N, Dv], each row's state after its last token [R, N, Dk, Dv]). A token's state
    at the chunk's start: the running one for the row that crosses into the chunk, else its row's start."""
    T, N, Dk = k.shape
    C = math.gcd(T, CHUNK)
    chunks = lambda a: a.reshape(T // C, C, *a.shape[1:])
    eye, lower = jnp.eye(C, dtype=jnp.float32), jnp.tril(jnp.ones((C, C), bool))

    def chunk(carry, xs):
        running, ends = carry
        start, q, k, v, g, beta, segment, row, first, last = xs
        local = jnp.maximum(first - start, 0)  # where each token's row starts in the chunk
        crossing = first < start
        S0 = jnp.where(crossing[:, None, None, None], running[None],
                       starts.at[row].get(mode="fill", fill_value=0.0))  # [C, N, Dk, Dv]: each token's row's
        total = jnp.cumsum(g, axis=0)  # [C, N]
        G = total - jnp.where((local > 0)[:, None], total[jnp.maximum(local - 1, 0)], 0.0)  # log decay since the row's start
        same = (segment[:, None] == segment[None, :]) & lower  # [C, C]: j is i's row's, not later
        decay = jnp.where(same[..., None], jnp.exp(jnp.where(same[..., None], G[:, None] - G[None, :], 0.0)), 0.0)  # [C, C, N]
        kb = k * beta[..., None]
        L = jnp.einsum("INK,JNK,IJN->NIJ", kb, k, decay) * (1.0 - eye)  # strictly below the diagonal
        A = jax.scipy.linalg.solve_triangular(eye + L, jnp.broadcast_to(eye, L.shape), lower=True)  # (I + L)^-1 per head
        U = jnp.einsum("NIJ,JNV->INV", A, v * beta[..., None])
        W = jnp.einsum("NIJ,JNK->INK", A, kb * jnp.exp(G)[..., None])
        fresh_v = U - jnp.einsum("INK,INKV->INV", W, S0)
        out = jnp.einsum("INK,INKV->INV", q * jnp.exp(G)[..., None], S0) + jnp.einsum(
            "INK,JNK,IJN,JNV->INV", q, k, decay, fresh_v)
        after = S0 * jnp.exp(G)[..., None, None] + jnp.einsum("IJN,JNK,JNV->INKV", decay, k, fresh_v)  # each token's row's state after it
        return (after[-1], _ends(ends, TokenRows(row, first, last), after)), out

    xs = (jnp.arange(0, T, C), *(chunks(a) for a in (q, k, v, g, beta, segment, *rows)))
    (_, ends), out = jax.lax.scan(chunk, (jnp.zeros((N, Dk, v.shape[-1]), jnp.float32), starts), xs)
    return out.reshape(T, N, -1), ends


def _delta_rule_by_token(q, k, v, g, beta, starts, segment, rows):
    """`_delta_rule` one token at a time (batch_invariant): a `lax.scan` over the step's tokens whose
    body is the same [N, Dk, Dv] arithmetic whatever the step, so a token's output and its row's
    state follow from its row alone in a fixed order, not from where the step's packing put chunk
    boundaries. The carry is the running row's state: a token that starts a row reads its row's
    start state; a row's last token writes its row's end state."""
    del segment  # `rows.first` says where each row starts

    def token(carry, xs):
        running, ends = carry
        index, q, k, v, g, beta, row, first, last = xs
        S = jnp.where(first == index, starts.at[row].get(mode="fill", fill_value=0.0), running) * jnp.exp(g)[:, None, None]
        S = S + k[:, :, None] * (beta[:, None] * (v - jnp.einsum("NK,NKV->NV", k, S)))[:, None, :]
        ends = _ends(ends, TokenRows(row[None], first[None], last[None]), S[None])
        return (S, ends), jnp.einsum("NK,NKV->NV", q, S)

    T, N, Dk = k.shape
    xs = (jnp.arange(T), q, k, v, g, beta, *rows)
    (_, ends), out = jax.lax.scan(token, (jnp.zeros((N, Dk, v.shape[-1]), jnp.float32), starts), xs)
    return out, ends
