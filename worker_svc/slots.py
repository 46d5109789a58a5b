"""The sampling parameters and LoRA adapter slot of the request in each slot, as the worker keeps them.

The scheduler sends a request's SamplingParams and adapter slot once per admission, with the first seq
after it takes its slot (StepSeq.sampling, StepSeq.adapter); its later seqs name only the slot. The worker runs steps in
stream order and a slot passes to another request only in a step after the one that freed it, so
the parameters a slot holds are those of the request whose seq names it; the rid is kept to prove it.
"""

from __future__ import annotations

from jaxstream.protocol import SamplingParams, Step


class StaleStep(Exception):
    """A step naming a request whose parameters this worker never received: planned for the worker
    before it, and left unread in the stream when that one died (its scheduler ends those requests)."""


class SlotParams:
    def __init__(self) -> None:
        self._held: dict[int, tuple[str, SamplingParams, int]] = {}  # slot -> (rid, its parameters, its adapter slot)
        self.adapters: list[int] = []  # the last step's seqs' adapter slots (-1: the base model), by `resolve`

    def resolve(self, step: Step) -> list[SamplingParams]:
        """Each seq's sampling parameters, in step order (and its adapter slot in `adapters`); a seq
        that brings them leaves them in its slot for the request's later seqs (a seq with no slot,
        slot -1, always brings them)."""
        params, self.adapters = [], []
        for seq in step.seqs:
            if seq.sampling is not None:
                if seq.slot >= 0:
                    self._held[seq.slot] = (seq.rid, seq.sampling, seq.adapter)
                params.append(seq.sampling)
                self.adapters.append(seq.adapter)
                continue
            rid, held, adapter = self._held.get(seq.slot, (None, None, -1))
            if rid != seq.rid:
                raise StaleStep(f"step {step.step_id}: request {seq.rid}'s slot {seq.slot} holds no sampling parameters "
                                f"of it ({'empty' if rid is None else f'request {rid} holds it'}); the scheduler sends them "
                                "with the request's first seq in its slot, so the step was planned for an earlier worker")
            params.append(held)
            self.adapters.append(adapter)
        return params
