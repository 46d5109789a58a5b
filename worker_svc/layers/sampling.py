"""Token sampling inside the jitted step: greedy, temperature, top-k, top-p and min-p, per row.

Shapes in the legend of worker_svc/__init__.py; the inverse-CDF search splits V into J chunks of C tokens.

How one row is sampled:
  1. Scale the logits by 1/T (T = 1 for greedy rows) and take e = exp(scaled - peak), the
     probability relative to the most likely token's: no softmax needs normalizing.
  2. Every filter keeps {e >= t} for some t, so together they are one threshold, the largest of
     theirs. Top-p applies to what top-k kept, renormalized, as in vLLM and Hugging Face; min-p
     to the whole scaled distribution (its t is min_p itself). top-k's and top-p's t come from
     bisections on t rather than a sort (a sort of [64, 49152] costs ~10x a bisection on CPU),
     each run only when some sampled row asks for it (lax.cond). The most likely token is
     always kept.
  3. One uniform per row, keyed by (seed, position) alone, picks a token by inverse CDF over the
     kept e: a chunk, then a token inside it, so no cumsum runs over all of V. A greedy row keeps
     only its most likely tokens and takes u = 0: the first of them, as jnp.argmax.
  4. The logprob is log_softmax(logits / T)[token] of the logits given (after penalties and bias,
     when the step ran them), before any filter or ban: the project's definition. A row with
     raw_logprobs takes log_softmax(raw)[token] instead (the model's own logits, T = 1); one with
     processed_logprobs, log(kept[token] / sum(kept)): the distribution step 3 drew from. Its top
     alternatives come from the same distribution, only when some row asks (lax.cond), and so do
     the logprobs of the ids it names (SGLang's token_ids_logprob, `ids`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxstream.protocol import MAX_BANNED_TOKENS, MAX_TOKEN_IDS_LOGPROB, MAX_TOP_LOGPROBS
from worker_svc.layers import abstract

# Bit pattern of float32 1.0. Non-negative float32 values order like their bit patterns as int32,
# so a bisection over [0, _ONE_BITS] in ints is a bisection over [0.0, 1.0] in floats; 30 halvings
# bring the interval (< 2**30 wide) down to one value, so the threshold found is exact.
_ONE_BITS = 0x3F800000
_BISECTION_STEPS = 30
MIN_TEMPERATURE = 1e-5
NO_TOKEN = 2**31 - 1  # pads SamplingInputs.banned and .ids: out of every vocabulary
_CHUNK = 256  # C: tokens per chunk of the inverse-CDF search; J = ceil(V / C) chunks
_ROW_BLOCK = 16  # most rows bisected together: their e, 16 x 49152 f32 = 3 MiB, stays in cache


class SamplingInputs(NamedTuple):
    """Per-row sampling parameters for one step: a pytree, every field [R]."""

    temperature: jax.Array  # [R] f32; < MIN_TEMPERATURE (0 included): greedy
    top_k: jax.Array  # [R] i32; <= 0 or >= V: off
    top_p: jax.Array  # [R] f32; >= 1: off
    min_p: jax.Array  # [R] f32; 0: off
    seed: jax.Array  # [R] u32
    position: jax.Array  # [R] i32: position of the token being sampled
    banned: jax.Array  # [R, M] i32: token ids the row must not sample; NO_TOKEN pads
    raw_logprobs: jax.Array  # [R] bool: logprobs and alternatives of the raw logits (T = 1)
    top_logprobs: jax.Array  # [R] i32: alternatives the row returns, 0..MAX_TOP_LOGPROBS
    processed_logprobs: jax.Array  # [R] bool: of the kept tokens, renormalized (not with raw_logprobs)
    # [R, I] i32: the ids whose logprobs the row returns (token_ids_logprob), NO_TOKEN pads; I is
    # MAX_TOKEN_IDS_LOGPROB, one compiled shape whatever a request asks
    ids: jax.Array

    @classmethod
    def padded(cls, rows: int, full: Callable = np.full) -> SamplingInputs:
        """Every row padding: greedy, no filter, no ban, no logprobs asked (layers/abstract.py)."""
        return cls(temperature=full(rows, 0.0, np.float32), top_k=full(rows, 0, np.int32), top_p=full(rows, 1.0, np.float32),
                   min_p=full(rows, 0.0, np.float32), seed=full(rows, 0, np.uint32), position=full(rows, 0, np.int32),
                   banned=full((rows, MAX_BANNED_TOKENS), NO_TOKEN, np.int32), raw_logprobs=full(rows, False, np.bool_),
                   top_logprobs=full(rows, 0, np.int32), processed_logprobs=full(rows, False, np.bool_),
                   ids=full((rows, MAX_TOKEN_IDS_LOGPROB), NO_TOKEN, np.int32))

    @classmethod
    def shapes(cls, rows: int) -> SamplingInputs:
        return cls.padded(rows, abstract.full)


class Sampled(NamedTuple):
    tokens: jax.Array  # [R] i32
    logprobs: jax.Array  # [R] f32
    # The A = top_count(V, width) most likely tokens of every row under its logprob's
    # distribution, best first (ties: lower id first); zeros when no row asked.
    top_ids: jax.Array  # [R, A] i32
    top_logprobs: jax.Array  # [R, A] f32
    # [R, I]: the logprobs of SamplingInputs.ids under the same distribution as `logprobs` (0 where
    # an id pads; zeros when no row asked)
    ids_logprobs: jax.Array


def sample(logits: jax.Array, inputs: SamplingInputs, raw: jax.Array | None = None, own_normalizer: bool = False,
           width: int = MAX_TOP_LOGPROBS) -> Sampled:
    """logits [R, V], processed (penalties and bias applied; the raw ones when none) -> Sampled.
    raw [R, V]: the model's logits, read only by raw_logprobs rows; None: `logits` are raw.
    own_normalizer (batch_invariant): every row's logprob from `normalizer`, the function a
    trainer and prompt scoring use, rather than from the sampler's own sum (same value, but its
    sum is fused with the sampler's other passes, and rounds differently).
    width: the most alternatives per row, A = min(width, V) (server.max_logprobs above
    MAX_TOP_LOGPROBS compiles a second sampler, executables.py; nothing else differs)."""
    # Below this, logits / T overflows float32 (inf - inf = NaN); such a row is greedy in effect.
    greedy = inputs.temperature < MIN_TEMPERATURE  # [R]
    temperature = jnp.where(greedy, 1.0, inputs.temperature).astype(jnp.float32)[:, None]  # [R, 1]
    processed = logits.astype(jnp.float32)
    raw = processed if raw is None else raw.astype(jnp.float32)
    rows = jnp.arange(processed.shape[0])[:, None]
    # Banned tokens (stop tokens before min_tokens) leave the distribution before anything else.
    logits = processed.at[rows, inputs.banned].set(-jnp.inf, mode="drop")  # [R, V]
    top_logit = jnp.max(logits, axis=-1, keepdims=True)  # [R, 1]
    # max(logits / T) is max(logits) / T: rounding is monotone. Taking it from the logits spares
    # XLA materializing the scaled [R, V].
    peak = top_logit / temperature  # [R, 1]
    e = jnp.exp(logits / temperature - peak)  # [R, V] p / p_max, 1 at the peak up to rounding
    total = jnp.sum(e, axis=-1)  # [R]

    # The most likely tokens are always kept, compared exactly on the logits: no threshold, however
    # it rounds against e, can leave a row with nothing. A greedy row keeps only them and draws
    # u = 0, so the search returns the lowest-index one, jnp.argmax's answer, without a pass of its own.
    threshold = jnp.where(greedy, jnp.inf, _threshold(e, inputs, greedy))  # [R]
    kept = jnp.where((logits == top_logit) | (e >= threshold[:, None]), e, 0.0)  # [R, V]
    u = jnp.where(greedy, 0.0, _uniforms(inputs.seed, inputs.position))  # [R]
    tokens = _inverse_cdf(kept, u)  # [R] int32

    # The logprob's distribution: base / t with base the processed logits (raw for raw_logprobs
    # rows) and t the temperature (1 for raw rows). With no ban and no raw row in the step, the
    # sampler's own peak and sum are its normalizer already.
    t = jnp.where(inputs.raw_logprobs[:, None], 1.0, temperature)  # [R, 1]

    def base():
        return jnp.where(inputs.raw_logprobs[:, None], raw, processed)  # [R, V]

    # Rows with a ban or raw logprobs take their own; the others keep the sampler's to the bit, so
    # a row's logprob does not depend on what shares its batch.
    own = jnp.any(inputs.banned < processed.shape[-1], axis=-1) | inputs.raw_logprobs | own_normalizer  # [R]

    def rows_normalizer():
        own_peak, own_total = normalizer(base(), t)
        return jnp.where(own[:, None], own_peak, peak), jnp.where(own, own_total, total)

    sampler_normalizer = (peak, total)
    peak, total = lax.cond(jnp.any(own), rows_normalizer, lambda: sampler_normalizer)
    log_total = jnp.log(total)  # [R]
    picked = jnp.where(inputs.raw_logprobs[:, None], jnp.take_along_axis(raw, tokens[:, None], axis=-1),
                       jnp.take_along_axis(processed, tokens[:, None], axis=-1))  # [R, 1]
    logprobs = log_prob(picked, t, peak, log_total)[:, 0]

    # processed_logprobs rows: log(kept / sum(kept)), -inf for a token the cut removed.
    cut = inputs.processed_logprobs & ~inputs.raw_logprobs  # [R]

    def kept_log_softmax():
        return jnp.log(kept) - jnp.log(jnp.sum(kept, axis=-1, keepdims=True))  # [R, V]

    def processed_logprobs():
        return jnp.where(cut, jnp.take_along_axis(kept_log_softmax(), tokens[:, None], axis=-1)[:, 0], logprobs)

    logprobs = lax.cond(jnp.any(cut), processed_logprobs, lambda: logprobs)
    wants = inputs.top_logprobs > 0  # [R]

    def with_alternatives():
        lp = log_prob(base(), t, peak, log_total)  # [R, V]
        lp = lax.cond(jnp.any(cut), lambda: jnp.where(cut[:, None], kept_log_softmax(), lp), lambda: lp)
        return best(lp, tokens, wants, logprobs, width)

    top_ids, top_logprobs, logprobs = lax.cond(jnp.any(wants), with_alternatives,
                                               lambda: (*no_alternatives(processed.shape, width), logprobs))

    def of_ids():
        lp = gather_log_prob(base(), t, peak, log_total, inputs.ids)
        return lax.cond(jnp.any(cut), lambda: jnp.where(cut[:, None], at_ids(kept_log_softmax(), inputs.ids), lp), lambda: lp)

    asked = inputs.ids < processed.shape[-1]  # [R, I]
    ids_logprobs = lax.cond(jnp.any(asked), of_ids, lambda: jnp.zeros(inputs.ids.shape, jnp.float32))
    return Sampled(tokens, logprobs, top_ids, top_logprobs, jnp.where(asked, ids_logprobs, 0.0))


# The logprob arithmetic, shared with prompt scoring (engine.score), so that a token's logprob and
# its entry among the alternatives are the same float: log_softmax(x / t) = (x / t - peak) - log(total).


def normalizer(base: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """base [R, V], t [R, 1] -> (peak [R, 1] = max(base) / t, total [R] = sum(exp(base / t - peak)))."""
    peak = jnp.max(base, axis=-1, keepdims=True) / t
    return peak, jnp.sum(jnp.exp(base / t - peak), axis=-1)


def log_prob(x: jax.Array, t: jax.Array, peak: jax.Array, log_total: jax.Array) -> jax.Array:
    """log_softmax(base / t) at logits x [R, 1] (or [R, V]) of base [R, V]."""
    return (x / t - peak) - log_total[:, None]


def at_ids(x: jax.Array, ids: jax.Array) -> jax.Array:
    """x [R, V] at ids [R, I]; an id out of the vocabulary (NO_TOKEN padding) reads the last entry,
    which the caller masks."""
    return jnp.take_along_axis(x, jnp.minimum(ids, x.shape[-1] - 1), axis=-1)


def gather_log_prob(base: jax.Array, t: jax.Array, peak: jax.Array, log_total: jax.Array, ids: jax.Array) -> jax.Array:
    """log_softmax(base / t) [R, I] at ids [R, I] (token_ids_logprob), by the same arithmetic as a
    token's own logprob."""
    return log_prob(at_ids(base, ids), t, peak, log_total)


def alternatives(base: jax.Array, t: jax.Array, peak: jax.Array, log_total: jax.Array, tokens: jax.Array, wants: jax.Array,
                 logprobs: jax.Array, width: int = MAX_TOP_LOGPROBS) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The A most likely tokens [R, A] of log_softmax(base / t) and their logprobs [R, A], best
    first (lax.top_k puts the lower index first among equals); and `logprobs` [R] of `tokens` [R]
    read from the same array where `wants`, so that a token among its alternatives shows the same
    float (XLA may round the division differently in the two places)."""
    return best(log_prob(base, t, peak, log_total), tokens, wants, logprobs, width)


def best(lp: jax.Array, tokens: jax.Array, wants: jax.Array, logprobs: jax.Array,
         width: int = MAX_TOP_LOGPROBS) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The A = min(width, V) most likely tokens [R, A] of the logprobs lp [R, V], and `logprobs`
    [R] of `tokens` read from lp where `wants` (see `alternatives`). lax.top_k orders ties by
    index, so a narrower width's alternatives are the wider one's first ones."""
    values, ids = lax.top_k(lp, top_count(lp.shape[-1], width))
    same = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    return ids.astype(jnp.int32), values, jnp.where(wants, same, logprobs)


def no_alternatives(shape: tuple[int, int], width: int = MAX_TOP_LOGPROBS) -> tuple[jax.Array, jax.Array]:
    k = top_count(shape[-1], width)
    return jnp.zeros((shape[0], k), jnp.int32), jnp.zeros((shape[0], k), jnp.float32)


def top_count(vocab: int, width: int = MAX_TOP_LOGPROBS) -> int:
    """A: the alternatives a row computes, for a width (server.max_logprobs; -1: the vocabulary)."""
    return vocab if width < 0 else min(width, vocab)


def _threshold(e: jax.Array, inputs: SamplingInputs, greedy: jax.Array) -> jax.Array:
    """The t [R] of each sampled row's kept set {e >= t}, in [0, 1]."""
    vocab = e.shape[-1]
    # min-p keeps p >= min_p * p_max, which is e >= min_p.
    min_p = jnp.clip(inputs.min_p.astype(jnp.float32), 0.0, 1.0)  # [R]
    top_k_on = (inputs.top_k > 0) & (inputs.top_k < vocab)
    top_p_on = inputs.top_p < 1.0
    # Greedy rows ignore their filters, so they alone never pay for the bisection.
    needed = jnp.any(~greedy & (top_k_on | top_p_on))
    return lax.cond(
        needed,
        lambda: jnp.maximum(min_p, _top_k_top_p_threshold(e, inputs, top_k_on, top_p_on)),
        lambda: min_p,
    )


def _top_k_top_p_threshold(
    e: jax.Array, inputs: SamplingInputs, top_k_on: jax.Array, top_p_on: jax.Array
) -> jax.Array:
    """The cut t [R] of top-k then top-p, in vLLM's order: top-p applies to the distribution top-k
    left, renormalized. t_k is the k-th largest e: the largest t with count(e >= t) >= k. Then t_p
    is the e of the kept token whose cumulative probability, highest first, reaches top_p of the
    kept mass: the largest t with mass(e >= max(t, t_k)) >= top_p * mass(e >= t_k). Both tests
    are monotone in t, so each is a bisection. An off filter's test never passes, giving 0 (keep
    everything); the cut is max(t_k, t_p).

    Equal e at the cut are all kept, so ties can keep more than k tokens."""
    rows, vocab = e.shape
    k = jnp.where(top_k_on, inputs.top_k, vocab + 1)  # [R]
    top_p = jnp.where(top_p_on, inputs.top_p.astype(jnp.float32), jnp.inf)  # [R]
    # A block of rows at a time (lax.map), so the 30 passes reread a block's e from cache, and the
    # temporaries are [block, V]. At [64, V] they grew the step's scratch past glibc's 32 MiB mmap
    # threshold, so every call, even one skipping this branch, paid fresh page faults: the plain
    # path ran ~4x slower on CPU.
    block = max(d for d in range(1, min(rows, _ROW_BLOCK) + 1) if rows % d == 0)

    def blocks(x):
        return x.reshape(rows // block, block, *x.shape[1:])

    bits = lax.map(_cut, (blocks(e), blocks(k), blocks(top_p)))  # [R / block, block]
    return lax.bitcast_convert_type(bits.reshape(rows), jnp.float32)


def _cut(block: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
    """Bits [b] of max(t_k, t_p) above, for e [b, V], k [b], top_p [b]."""
    e, k, top_p = block
    off = jnp.zeros(k.shape, jnp.int32)
    t_k = lax.cond(jnp.any(k <= e.shape[-1]), lambda: _bisect(lambda above: jnp.sum(above, axis=-1) >= k, e), lambda: off)
    e_k = jnp.where(e >= lax.bitcast_convert_type(t_k, jnp.float32)[:, None], e, 0.0)  # what top-k kept
    mass_needed = top_p * jnp.sum(e_k, axis=-1)  # [b]

    def t_p():
        return _bisect(lambda above: jnp.sum(jnp.where(above, e_k, 0.0), axis=-1) >= mass_needed, e)

    return jnp.maximum(t_k, lax.cond(jnp.any(jnp.isfinite(top_p)), t_p, lambda: off))


def _bisect(passes: Callable[[jax.Array], jax.Array], e: jax.Array) -> jax.Array:
    """Bits [b] of the largest t in [0, 1] whose kept set {e >= t} [b, V] passes, else 0."""

    def halve(_, bounds):
        lo, hi = bounds  # [b] int32 bits; invariant: lo passes (or is 0), everything above hi fails
        mid = lo + (hi - lo + 1) // 2
        ok = passes(e >= lax.bitcast_convert_type(mid, jnp.float32)[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo = jnp.zeros(e.shape[:1], jnp.int32)
    hi = jnp.full(e.shape[:1], _ONE_BITS, jnp.int32)
    lo, _ = lax.fori_loop(0, _BISECTION_STEPS, halve, (lo, hi))
    return lo


def _uniforms(seed: jax.Array, position: jax.Array) -> jax.Array:
    """One uniform in [0, 1) per row [R], a function of that row's (seed, position) only, so a seeded
    request draws the same whatever shares its batch and whichever row it lands in."""

    def one(seed, position):
        # threefry named, not taken from the global config: the draws must not change with it.
        key = jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), position)
        return jax.random.uniform(key, dtype=jnp.float32)

    return jax.vmap(one)(seed.astype(jnp.uint32), position.astype(jnp.int32))


def _inverse_cdf(kept: jax.Array, u: jax.Array) -> jax.Array:
    """The token [R] where the cumulative kept weight first exceeds u * (total kept weight).

    In two levels, chunks then tokens, so the only cumsums are over J and C, not V: a cumsum over
    [64, 49152] costs more on CPU than all the rest of plain sampling. Both levels pick only entries with
    positive weight, so a filtered-out (or underflowed) token is never returned, whatever the
    rounding of u * total or of the sums."""
    rows, vocab = kept.shape
    size = min(_CHUNK, vocab)
    chunks = -(-vocab // size)
    # Zero padding to whole chunks: weightless, so never picked.
    w = jnp.pad(kept, ((0, 0), (0, chunks * size - vocab))).reshape(rows, chunks, size)  # [R, J, C]
    chunk_mass = jnp.sum(w, axis=-1)  # [R, J]
    cum = jnp.cumsum(chunk_mass, axis=-1)  # [R, J]
    target = u * cum[:, -1]  # [R]
    g = _search(cum, target, chunk_mass > 0)  # [R]

    inside = jnp.take_along_axis(w, g[:, None, None], axis=1)[:, 0]  # [R, C]
    before = jnp.where(g > 0, jnp.take_along_axis(cum, jnp.maximum(g - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    c = _search(jnp.cumsum(inside, axis=-1), target - before, inside > 0)  # [R]
    return g * size + c


def _search(cum: jax.Array, target: jax.Array, positive: jax.Array) -> jax.Array:
    """First index [R] with cum > target among positive entries of [R, J] or [R, C]; if rounding left none
    (target at the very end), the last positive entry. Callers guarantee one is positive."""
    n = cum.shape[-1]
    index = jnp.arange(n, dtype=jnp.int32)
    first = jnp.min(jnp.where((cum > target[:, None]) & positive, index, n), axis=-1)
    last = jnp.max(jnp.where(positive, index, -1), axis=-1)
    return jnp.where(first < n, first, last)
