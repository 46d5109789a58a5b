"""The detokenizer's state across requests: which request each token belongs to, and where its output goes.

Step results are taken in step order, checked by step id: a scheduler numbers its steps one by
one, its worker publishes a result for each, and this detokenizer reads every result of every
replica. So per replica the next result is the last one's step + 1. One that is not newer than the
last was delivered twice (dropped). One further ahead means results never reached this
detokenizer (trimmed from a stream it fell too far behind on, a worker that died between steps) or
a new scheduler (its ids go on from the clock): either way the requests of that replica it holds
that started before the first missing step may have lost a token, and end with an error rather
than go on with a hole in their text; their scheduler is told to stop them.
"""

from __future__ import annotations

import logging

from detokenizer_svc.request import DetokRequest
from detokenizer_svc.token_text import TokenTexts
from jaxstream import protocol
from jaxstream.arrays import from_wire
from jaxstream.english import counted
from jaxstream.protocol import FinishReason

log = logging.getLogger(__name__)


class Detokenizer:
    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self.texts = TokenTexts(tokenizer)  # shared cache of each token's own text
        self.requests: dict[str, DetokRequest] = {}
        self.started = 0
        self.last_step: dict[int, int] = {}  # replica -> the step id of the last result taken

    def reset(self) -> None:
        """Redis restarted: every request and every stream is gone."""
        self.requests.clear()
        self.last_step.clear()

    def step(self, messages: list[object]) -> tuple[dict[str, list[protocol.RequestOutput]], dict[int, list[str]]]:
        """(outputs by gateway, rids a stop string ended by the replica whose scheduler holds them)."""
        outputs: dict[str, list[protocol.RequestOutput]] = {}
        stopped: dict[int, list[str]] = {}
        for message in messages:
            match message:
                case protocol.RequestEvents(started=started, ended=ended, cache_hits=hits):
                    for start in started:
                        held = self.requests.get(start.rid)
                        if held is None or held.start != start:  # else the same start delivered twice
                            self.requests[start.rid] = DetokRequest(start, self.tokenizer, self.texts)
                    self.started += len(started)
                    for hit in hits:  # with the request's first step: before any of its outputs
                        if (request := self.requests.get(hit.rid)) is not None:
                            request.cached_tokens = hit.cached_tokens
                    for end in ended:
                        request = self.requests.pop(end.rid, None)
                        final = request.end(end.finish) if request else protocol.RequestOutput(end.rid, finish=end.finish)
                        outputs.setdefault(end.gateway, []).append(final)
                case protocol.StepResult() if self._in_order(message, outputs, stopped):
                    self._result(message, outputs, stopped)
        return outputs, stopped

    def _in_order(self, result: protocol.StepResult, outputs: dict[str, list[protocol.RequestOutput]],
                  stopped: dict[int, list[str]]) -> bool:
        """Whether to take this result: the next of its replica (this module's docstring)."""
        last = self.last_step.get(result.replica)
        if last is not None and result.step_id <= last:
            log.warning("result of step %d of replica %d after step %d's: a duplicate, dropped", result.step_id,
                        result.replica, last)
            return False
        self.last_step[result.replica] = result.step_id
        if last is not None and result.step_id > last + 1:
            self._fail_before(result.replica, last + 1, result.step_id, outputs, stopped)
        return True

    def _fail_before(self, replica: int, missing: int, step_id: int, outputs: dict[str, list[protocol.RequestOutput]],
                     stopped: dict[int, list[str]]) -> None:
        """Results of the replica's steps [missing, step_id) never came: end with an error every
        request of the replica whose first step came before step_id (it may have had a token in them)."""
        lost = [r for r in self.requests.values() if r.start.replica == replica and r.start.first_step < step_id]
        log.warning("results of replica %d jumped from step %d to %d (results lost, or a new scheduler): %s failed",
                    replica, missing - 1, step_id, counted(len(lost), "request"))
        finish = FinishReason("error", message=f"replica {replica}'s step results did not all reach the detokenizer; "
                                               "the request was lost, retry it")
        for request in lost:
            del self.requests[request.start.rid]
            if (output := request.end(finish)) is not None:
                outputs.setdefault(request.start.gateway, []).append(output)
            stopped.setdefault(replica, []).append(request.start.rid)

    def _result(self, result: protocol.StepResult, outputs: dict[str, list[protocol.RequestOutput]],
                stopped: dict[int, list[str]]) -> None:
        for experts in result.experts:  # before the tokens, whose last output takes them
            if (request := self._request_of(experts.rid, result)) is not None:
                request.on_experts(experts.first, from_wire(experts.ids))
        for scores in result.scores:  # before the tokens: they go out with the request's first one
            if (request := self._request_of(scores.rid, result)) is not None:
                # a request that samples nothing ends with its last scores (no token of it comes)
                self._emit(request, request.on_scores(scores, result.weight_version), outputs, stopped)
        # [S, N] alternatives, row r for rids[r], when some request of the step asked for them
        tops = None if result.top_ids is None or result.top_logprobs is None else (
            from_wire(result.top_ids), from_wire(result.top_logprobs))
        of_ids = None if result.ids_logprobs is None else from_wire(result.ids_logprobs)  # [S, I], when some request asked
        row = 0
        while row < len(result.rids):  # a verified draft's tokens are consecutive rows of its rid: one output
            rid, end = result.rids[row], row + 1
            while end < len(result.rids) and result.rids[end] == rid:
                end += 1
            rows, row = slice(row, end), end
            request = self._request_of(rid, result)
            if request is None:
                continue
            top_ids, top_logprobs = (None, None) if tops is None else (tops[0][rows], tops[1][rows])
            ids = None if of_ids is None else of_ids[rows]
            output = request.on_tokens(result.token_ids[rows], result.logprobs[rows], top_ids, top_logprobs, result.weight_version, ids)
            self._emit(request, output, outputs, stopped)

    def _emit(self, request: DetokRequest, output: protocol.RequestOutput | None, outputs: dict[str, list[protocol.RequestOutput]],
              stopped: dict[int, list[str]]) -> None:
        """Send a request's new output, if any, to its gateway; forget it once finished."""
        if output is None:
            return
        outputs.setdefault(request.start.gateway, []).append(output)
        if request.finished:
            del self.requests[request.start.rid]
            if request.stopped_by_string:
                stopped.setdefault(request.start.replica, []).append(request.start.rid)

    def _request_of(self, rid: str, result: protocol.StepResult) -> DetokRequest | None:
        """The request this result's row is for; None for another detokenizer's, or one ended already
        (aborted or stopped mid-step, or its last token in flight when a step followed it), even
        when a new request has taken its rid since (its steps start later)."""
        request = self.requests.get(rid)
        if request is None or request.start.replica != result.replica or result.step_id < request.start.first_step:
            return None
        return request
