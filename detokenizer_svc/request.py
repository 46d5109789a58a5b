"""One request's detokenization state: tokens in, RequestOutput (text, tokens, finish) out.

Per token: 1. count it and apply the shared finish rule (`jaxstream.stopping`): stop token or
length; 2. decode its text (IncrementalDetokenizer), flushing held bytes if it finishes the
request; 3. pass the text through the StopMatcher, which cuts it at a stop string. A stop string
finishes the request unless a stop token did on the same token (stop tokens take precedence,
as in vLLM); the scheduler cannot see text, so `stopped_by_string` tells the service to stop it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from detokenizer_svc.incremental import IncrementalDetokenizer
from detokenizer_svc.stops import StopMatcher
from jaxstream.protocol import FinishReason, RequestOutput, RequestStart
from jaxstream.stopping import finish_reason


class DetokRequest:
    def __init__(self, start: RequestStart, tokenizer: Any) -> None:
        self.start = start
        self.completion_tokens = 0
        self.finish: FinishReason | None = None
        self.stopped_by_string = False
        self._detok = IncrementalDetokenizer(tokenizer, start.skip_special_tokens)
        self._stops = StopMatcher(start.stop)

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def on_tokens(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> RequestOutput | None:
        """This step's new tokens. Tokens after the one that finishes the request are dropped
        (normally a step brings one token); None once the request has finished."""
        if self.finished:
            return None
        start, text, taken = self.start, [], 0
        for token_id in token_ids:
            taken += 1
            self.completion_tokens += 1
            finish = finish_reason(
                token_id,
                self.completion_tokens,
                start.stop_token_ids,
                start.max_new_tokens,
                start.min_new_tokens,
            )
            new = self._detok.push([token_id])
            if finish is not None:
                new += self._detok.finish()
            if self.completion_tokens < start.min_new_tokens:
                text.append(new)  # like vLLM: no stop strings before min_new_tokens
            else:
                sent, matched = self._stops.push(new)
                text.append(sent)
                if matched is not None and (finish is None or finish.type == "length"):
                    finish = FinishReason("stop", matched=matched)
                    self.stopped_by_string = True
                if finish is not None and matched is None:
                    text.append(self._stops.finish())
            if finish is not None:
                self.finish = finish
                break
        return self._output("".join(text), tuple(token_ids[:taken]), tuple(logprobs[:taken]))

    def end(self, finish: FinishReason) -> RequestOutput | None:
        """Finish decided elsewhere (abort, error): flush held text; None if already finished."""
        if self.finished:
            return None
        self.finish = finish
        sent, matched = self._stops.push(self._detok.finish())
        return self._output(sent + (self._stops.finish() if matched is None else ""), (), ())

    def _output(self, text: str, token_ids: tuple[int, ...], logprobs: tuple[float, ...]) -> RequestOutput:
        return RequestOutput(
            rid=self.start.rid,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            finish=self.finish,
            prompt_tokens=self.start.prompt_tokens,
            completion_tokens=self.completion_tokens,
        )
