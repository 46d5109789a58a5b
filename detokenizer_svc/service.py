"""The detokenizer's state across requests: which request each token belongs to, and where its output goes."""

from __future__ import annotations

from detokenizer_svc.request import DetokRequest
from jaxstream import protocol


class Detokenizer:
    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, DetokRequest] = {}
        self.started = 0

    def step(self, messages: list[object]) -> tuple[dict[str, list[protocol.RequestOutput]], list[str]]:
        """(outputs by gateway, rids a stop string ended)."""
        outputs: dict[str, list[protocol.RequestOutput]] = {}
        stopped: list[str] = []
        for message in messages:
            match message:
                case protocol.RequestEvents(started=started, ended=ended):
                    for start in started:
                        self.requests[start.rid] = DetokRequest(start, self.tokenizer)
                    self.started += len(started)
                    for end in ended:
                        request = self.requests.pop(end.rid, None)
                        final = request.end(end.finish) if request else protocol.RequestOutput(end.rid, finish=end.finish)
                        outputs.setdefault(end.gateway, []).append(final)
                case protocol.StepResult(rids=rids, token_ids=token_ids, logprobs=logprobs):
                    for rid, token, logprob in zip(rids, token_ids, logprobs):
                        request = self.requests.get(rid)
                        if request is None:
                            continue  # another detokenizer's, or ended already (aborted or stopped mid-step)
                        output = request.on_tokens([token], [logprob])
                        if output is None:
                            continue
                        outputs.setdefault(request.start.gateway, []).append(output)
                        if request.finished:
                            del self.requests[rid]
                            if request.stopped_by_string:
                                stopped.append(rid)
        return outputs, stopped
