"""Constrained decoding on the worker: each constrained request's grammar state, and the token mask
of every constrained row, computed on the host while the device runs the step's forward pass.

Why here. The worker is where a sampled token is first known (its step's read-back) and where the
next step's logits are: a matcher kept beside the device advances by each token as it comes back,
and the next step's mask is ready before that step samples. Nothing crosses Redis per token (a
scheduler-side matcher would have to ship a mask with every step), and overlap scheduling is
untouched: the scheduler plans step N+1 before step N's result reaches it, but the worker runs its
steps in order, so when step N+1 starts here step N's tokens are on the host already.

Per slot, as the sampling parameters (slots.py): a request's matcher is built when its first seq
since admission brings its SamplingParams with a constraint, and replaced by the next request
that takes the slot. Every output token reaches the matcher once, by position: a sampled token at
its position right after the step that sampled it, and the output tokens a step feeds (a request
readmitted after preemption feeds its own output again as prompt, or brings it as StepSeq.history
after a prefix cache hit) only when the matcher has not consumed that position yet. So a recompute
rebuilds the same state, and the token an overlapped seq feeds (the one its slot sampled) is
skipped: consumed when it came back.

A row's mask allows the tokens that keep the output a prefix of a match, and the end-of-sequence
token once the output is a whole match. A matcher that stopped (the match is complete and allows
nothing more) or failed (which only a token outside its mask could cause) allows only the
end-of-sequence token, so the request ends rather than run on unconstrained. Such a row is
`ending`: min_tokens' ban on stop tokens is lifted for it (the engine clears it), else it would
have no token left at all; it then samples end-of-sequence tokens, which do not finish it before
min_tokens (jaxstream/stopping.py) and which the text skips, so its text stays the match.

Masks are bitmasks, 32 tokens to an int32 ([R, W], W = ceil(V / 32)), llguidance's layout; an
unconstrained row's is all ones. llguidance computes a step's rows in parallel threads with the GIL
released, so this overlaps the forward pass that JAX runs asynchronously.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from jaxstream import grammar
from jaxstream.arrays import from_wire
from jaxstream.protocol import SamplingParams, Step, StepSeq

log = logging.getLogger(__name__)

TIMES_KEPT = 256  # mask computations whose times the stats' percentiles cover (benchmarks/structured.py reads them per mix)


def bitmask_width(vocab: int) -> int:
    return (vocab + 31) // 32


class _Held:
    """One request's matcher and how many output tokens it consumed."""

    def __init__(self, rid: str, prompt_len: int, matcher: llguidance.LLMatcher) -> None:
        self.rid = rid
        self.prompt_len = prompt_len
        self.matcher = matcher
        self.consumed = 0
        self.reported = False  # its failure was logged

    def consume(self, position: int, token: int) -> None:
        """The output token at `position`, when it is the next one the matcher has not seen."""
        if position == self.prompt_len + self.consumed:
            self.matcher.consume_token(token)
            self.consumed += 1


class Constraints:
    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab: int, eos_token_ids: tuple[int, ...]) -> None:
        """`tokenizer`: llguidance's view of the model's tokenizer, over the model's `vocab` ids."""
        self.tokenizer = tokenizer
        self.vocab = vocab
        self.width = bitmask_width(vocab)
        self.eos = [t for t in eos_token_ids if t < vocab]
        self._held: dict[int, _Held] = {}  # slot -> the matcher of the request in it
        self._executor = llguidance.LLExecutor()
        self.mask_ms: deque[float] = deque(maxlen=TIMES_KEPT)

    @classmethod
    def for_tokenizer(cls, hf_tokenizer, vocab: int, eos_token_ids: tuple[int, ...]) -> Constraints:
        """From a fast Hugging Face tokenizer (jaxstream.model_files.load_tokenizer's); ~0.3 s for SmolLM2's."""
        return cls(llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab, eos_token=list(eos_token_ids)), vocab, eos_token_ids)

    def admit(self, step: Step, params: list[SamplingParams]) -> None:
        """Build the matcher of every constrained request this Step admits to a slot, and feed every
        matcher the output tokens the Step feeds that it has not consumed (a recompute)."""
        tokens = None
        for seq, p in zip(step.seqs, params):
            if p.constraint is None or seq.slot < 0:
                continue
            if seq.sampling is not None:  # the first seq since it took its slot
                matcher = llguidance.LLMatcher(self.tokenizer, grammar.grammar(p.constraint))
                self._held[seq.slot] = held = _Held(seq.rid, seq.prompt_len, matcher)
                if seq.history is not None:  # the positions a prefix cache hit skipped
                    self._feed(held, 0, from_wire(seq.history))
            if not seq.follows and seq.context_len > seq.prompt_len:  # feeds output tokens
                tokens = from_wire(step.tokens) if tokens is None else tokens
                self._feed(self._held[seq.slot], seq.context_len - seq.num_tokens, tokens[seq.start : seq.start + seq.num_tokens])

    def _feed(self, held: _Held, start: int, tokens: np.ndarray) -> None:
        for i in range(max(0, held.prompt_len + held.consumed - start), len(tokens)):
            held.consume(start + i, int(tokens[i]))

    def masks(self, seqs: list[StepSeq], params: list[SamplingParams], rows: int) -> tuple[np.ndarray, list[int]] | None:
        """[rows, W] int32 bitmasks of the sampled rows `seqs` (in row order, padded to `rows`), all
        ones for an unconstrained row, and the rows that may only end; None when no row is constrained."""
        constrained = [(r, self._held[seq.slot]) for r, (seq, p) in enumerate(zip(seqs, params)) if p.constraint is not None and seq.slot >= 0]
        if not constrained:
            return None
        started = time.perf_counter()
        masks = np.full((rows, self.width), -1, np.int32)
        live = [(held.matcher, r) for r, held in constrained if not (held.matcher.is_stopped() or held.matcher.is_error())]
        if live:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, live, masks)
        # Stopped, failed before, or failed computing its mask (a resource limit)
        ending = [r for r, held in constrained if held.matcher.is_stopped() or held.matcher.is_error()]
        for r, held in constrained:
            if r in ending:
                self._only_eos(masks[r], held)
        self.mask_ms.append((time.perf_counter() - started) * 1000)
        return masks, ending

    def _only_eos(self, mask: np.ndarray, held: _Held) -> None:
        mask[:] = 0
        for t in self.eos:
            mask[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        if held.matcher.is_error() and not held.reported:
            held.reported = True
            log.warning("request %s: its constraint's matcher failed (%s); it may only end now", held.rid, held.matcher.get_error())

    def sampled(self, seqs: list[StepSeq], params: list[SamplingParams], tokens: list[int]) -> None:
        """Advance each constrained row's matcher by the token it sampled (`tokens`, in row order)."""
        for seq, p, token in zip(seqs, params, tokens):
            if p.constraint is not None and seq.slot >= 0:
                self._held[seq.slot].consume(seq.context_len, token)

    def stats(self) -> dict[str, float]:
        """The mask computation's time per step, over the last TIMES_KEPT steps with a constrained row."""
        if not self.mask_ms:
            return {}
        p50, p99 = np.percentile(np.asarray(self.mask_ms), [50, 99])
        return {"constraint_mask_ms_p50": round(float(p50), 3), "constraint_mask_ms_p99": round(float(p99), 3)}
