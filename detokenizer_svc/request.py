"""One request's detokenization state: tokens in, RequestOutput (text, tokens, finish) out.

Per token: 1. count it and apply the shared finish rule (`jaxstream.stopping`): stop token or
length; 2. decode its text (IncrementalDetokenizer), flushing held bytes if it finishes the
request; 3. pass the text through the StopMatcher, which cuts it at a stop string or pattern.
A stop string or pattern finishes the request unless a stop token did on the same token (stop
tokens take precedence, as in vLLM); the scheduler cannot see text, so `stopped_by_string` tells
the service to stop it.

Logprob extras, as the request asked (RequestStart): each token's own text (`token_texts`), its
`top_logprobs` alternatives, the logprobs of the ids it named (`token_ids_logprob`, in its order),
and the prompt's logprobs (with those of the named ids, and each prompt token's rank), which arrive over one or more steps before
the first sampled token and go out all at once in the request's first output (or its end output
when it ends before sampling anything); so do the prompt's token ids, when asked (prompt_ids). A
request that asked for no token (max_new_tokens 0, the shared `prefill_only` rule) ends with the
score of its last prompt position, all its scores in its one output; one that scores nothing ends
when the scheduler says so (`end`).

Harmony's channels, when the request asked (RequestStart.channels: a chat of GPT-OSS): the tokens
each output carries are read by channel too (channels.py), in `RequestOutput.channels`; `text`
stays the plain decoding, stop strings and patterns matched on it.

Routed experts, when the request asked (RequestStart.routed_experts_from >= 0): each step's rows
(StepResult.experts) are kept by position and go out once, with the last output: positions
[from, prompt + completion tokens - 1), or those of them that ran before an abort ended it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from detokenizer_svc.channels import Channels
from detokenizer_svc.incremental import IncrementalDetokenizer
from detokenizer_svc.stops import SlowPattern, StopMatcher
from detokenizer_svc.token_text import TokenTexts
from jaxstream import harmony
from jaxstream.arrays import from_wire, to_wire
from jaxstream.protocol import Array, FinishReason, PromptScores, RequestOutput, RequestStart, TokenLogprob
from jaxstream.stopping import finish_reason, prefill_only

Tops = tuple[tuple[TokenLogprob, ...], ...]  # per token, best first


class DetokRequest:
    def __init__(self, start: RequestStart, tokenizer: Any, texts: TokenTexts | None = None) -> None:
        self.start = start
        self.rule = start.finish
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the prefix cache gave it (a CacheHit event)
        self.finish: FinishReason | None = None
        self.stopped_by_string = False
        self._detok = IncrementalDetokenizer(tokenizer, start.skip_special_tokens)
        self._stops = StopMatcher(start.stop, start.stop_regex, keep_stop=start.no_stop_trim)
        self._texts = (texts or TokenTexts(tokenizer)) if start.logprob_texts else None
        self._prompt_scores: list[PromptScores] | None = []  # None once sent with the first output
        self._experts: list[tuple[int, np.ndarray]] = []  # (first position, rows [n, L, k]), in arrival order
        self._prompt_ids = start.prompt_ids  # asked for (return_prompt_token_ids): with the first output, then ()
        self.sent = 0  # outputs made: each carries its number (RequestOutput.seq), for the gateway to check the order
        self._channels = Channels(harmony.encoding()) if start.channels else None

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def on_scores(self, scores: PromptScores, weight_version: str = "") -> RequestOutput | None:
        """Logprobs of some prompt tokens (a step that fed them); kept until the first output. A
        request that samples nothing ends with the scores that reach its last prompt position: its
        one output, returned."""
        if self._prompt_scores is None or self.finished:
            return None
        self._prompt_scores.append(scores)
        finish = prefill_only(self.rule)
        if finish is None or scores.first + len(scores.token_ids) < self.start.prompt_tokens:
            return None  # the scheduler asks for each position once, in order: more are coming
        self.finish = finish
        return self._output("", (), (), weight_version=weight_version)

    def on_experts(self, first: int, ids: np.ndarray) -> None:
        """A step's routed experts of this request: rows [n, L, k] for positions first, first + 1, ..."""
        if not self.finished and self.start.routed_experts_from >= 0:
            self._experts.append((first, ids))

    def on_tokens(self, token_ids: Sequence[int], logprobs: Sequence[float], top_ids: np.ndarray | None = None,
                  top_logprobs: np.ndarray | None = None, weight_version: str = "",
                  ids_logprobs: np.ndarray | None = None) -> RequestOutput | None:
        """This step's new tokens, with their alternatives ([n, A] rows, best first, A >= the
        request's top_logprobs) when the step computed some, and the logprobs of the request's
        token_ids_logprob ([n, I] rows, I >= their count) when some request of the step asked. Tokens after the one that finishes
        the request are dropped (a step brings one token, or a verified draft's several); None once
        the request has finished."""
        if self.finished:
            return None
        text, taken = [], 0
        for token_id in token_ids:
            taken += 1
            self.completion_tokens += 1
            finish = finish_reason(token_id, self.completion_tokens, self.rule)
            new = self._detok.push([token_id])
            if finish is not None:
                new += self._detok.finish()
            # like vLLM: no stop strings before min_new_tokens
            try:
                sent, matched = self._stops.push(new, check=self.completion_tokens >= self.rule.min_new_tokens)
            except SlowPattern as slow:  # ends this request alone, as a stop would (the scheduler is told)
                sent, matched, finish = "", None, FinishReason("abort", message=str(slow))
                self.stopped_by_string = True
            text.append(sent)
            if matched is not None and (finish is None or finish.type == "length"):
                finish = FinishReason("stop", matched=matched)
                self.stopped_by_string = True
            if finish is not None and matched is None:
                text.append(self._stops.finish())
            if finish is not None:
                self.finish = finish
                break
        tops = self._tops(top_ids, top_logprobs)[:taken] if top_ids is not None and top_logprobs is not None else ()
        of_ids = self._of_ids(ids_logprobs[:taken]) if ids_logprobs is not None and self.start.token_ids_logprob else ()
        return self._output("".join(text), tuple(token_ids[:taken]), tuple(logprobs[:taken]), tops, weight_version, of_ids)

    def end(self, finish: FinishReason) -> RequestOutput | None:
        """Finish decided elsewhere (abort, error): flush held text; None if already finished."""
        if self.finished:
            return None
        self.finish = finish
        try:
            sent, matched = self._stops.push(self._detok.finish())
        except SlowPattern:  # it ends anyway, for its own reason
            sent, matched = "", None
        return self._output(sent + (self._stops.finish() if matched is None else ""), (), ())

    def _output(self, text: str, token_ids: tuple[int, ...], logprobs: tuple[float, ...], tops: Tops = (),
                weight_version: str = "", of_ids: Tops = ()) -> RequestOutput:
        """`weight_version`: of the weights whose step computed these tokens (or scores)."""
        prompt_logprobs, prompt_tops, prompt_of_ids, prompt_ranks = self._take_prompt_logprobs()
        prompt_ids, self._prompt_ids = self._prompt_ids, ()
        texts = [self._texts(i) for i in token_ids] if self._texts else []
        self.sent += 1
        channels = self._channels.feed(token_ids, last=self.finished) if self._channels else ()
        return RequestOutput(
            rid=self.start.rid,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            finish=self.finish,
            prompt_tokens=self.start.prompt_tokens,
            completion_tokens=self.completion_tokens,
            token_texts=tuple(text for text, _ in texts),
            token_raws=tuple(raw for _, raw in texts) if any(raw is not None for _, raw in texts) else (),
            top_logprobs=tops,
            prompt_logprobs=prompt_logprobs,
            prompt_top_logprobs=prompt_tops,
            cached_tokens=self.cached_tokens,
            weight_version=weight_version,
            routed_experts=self._routed_experts() if self.finished else None,
            token_ids_logprobs=of_ids,
            prompt_token_ids_logprobs=prompt_of_ids,
            prompt_ranks=prompt_ranks,
            prompt_token_ids=prompt_ids,
            seq=self.sent,
            channels=channels,
        )

    def _routed_experts(self) -> Array | None:
        """[n, L, k] i32: the rows of positions [from, prompt + completion - 1) received, up to the
        first missing one (an abort can end a request before its last step's result). A position
        that came twice (a recompute after preemption) keeps its later rows. None: none asked or came."""
        if not self._experts:
            return None
        start, end = self.start.routed_experts_from, self.start.prompt_tokens + self.completion_tokens - 1
        rows = np.zeros((max(end - start, 0), *self._experts[0][1].shape[1:]), np.int32)
        filled = np.zeros(len(rows), bool)
        for first, ids in self._experts:
            a, b = max(first, start), min(first + len(ids), end)
            if a < b:
                rows[a - start : b - start], filled[a - start : b - start] = ids[a - first : b - first], True
        return to_wire(rows[: len(rows) if filled.all() else int(np.argmin(filled))])

    def _logprob(self, token_id: int, logprob: float) -> TokenLogprob:
        if self._texts is None:
            return TokenLogprob(token_id, logprob)
        text, raw = self._texts(token_id)
        return TokenLogprob(token_id, logprob, text, raw)

    def _tops(self, top_ids: np.ndarray, top_logprobs: np.ndarray, k: int | None = None) -> Tops:
        """The first k (default: top_logprobs) alternatives of each row. Padding is left out: a row of it (prompt
        position 0, which nothing predicts: ids < 0, NaN logprobs), and with processed logprobs the
        tokens the top-k/top-p/min-p cut removed (logprob -inf)."""
        k = self.start.top_logprobs if k is None else k
        if k <= 0:
            return ()
        return tuple(tuple(self._logprob(int(i), float(lp)) for i, lp in zip(ids[:k], lps[:k]) if i >= 0 and np.isfinite(lp))
                     for ids, lps in zip(top_ids, top_logprobs))

    def _of_ids(self, rows: np.ndarray) -> Tops:
        """Per row [I] of logprobs of the request's token_ids_logprob (its first len of them), one
        TokenLogprob per id in the asked order; a row of NaN (prompt position 0: nothing predicts
        it) gives none."""
        asked = self.start.token_ids_logprob
        return tuple(() if np.isnan(row[: len(asked)]).all() else tuple(self._logprob(i, float(lp)) for i, lp in zip(asked, row))
                     for row in rows)

    def _take_prompt_logprobs(self) -> tuple[tuple[TokenLogprob, ...], Tops, Tops, tuple[int, ...]]:
        """Every prompt logprob received, in position order, with the alternatives, the named ids'
        logprobs and the ranks, the first time it is called; then ()."""
        scores, self._prompt_scores = self._prompt_scores, None
        if not scores:
            return (), (), (), ()
        scores.sort(key=lambda s: s.first)
        logprobs = tuple(self._logprob(t, lp) for s in scores for t, lp in zip(s.token_ids, s.logprobs))
        tops: Tops = ()
        k = self.start.top_logprobs if self.start.prompt_top_logprobs < 0 else self.start.prompt_top_logprobs
        if k > 0 and all(s.top_ids is not None and s.top_logprobs is not None for s in scores):
            tops = tuple(row for s in scores for row in self._tops(from_wire(s.top_ids), from_wire(s.top_logprobs), k))
        of_ids: Tops = ()
        if self.start.token_ids_logprob and all(s.ids_logprobs is not None for s in scores):
            of_ids = tuple(row for s in scores for row in self._of_ids(from_wire(s.ids_logprobs)))
        ranks = tuple(int(r) for s in scores for r in from_wire(s.ranks)) if all(s.ranks is not None for s in scores) else ()
        return logprobs, tops, of_ids, ranks
