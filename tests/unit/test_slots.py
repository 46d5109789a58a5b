"""The worker's table of sampling parameters by slot (worker_svc/slots.py): sent once per admission,
named by slot after, proven by rid."""

import numpy as np
import pytest

from jaxstream.arrays import to_wire
from jaxstream.protocol import SamplingParams, Step, StepSeq
from worker_svc.slots import SlotParams, StaleStep

GREEDY, HOT = SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=5)


def step(*seqs: StepSeq) -> Step:
    n = len(seqs)
    return Step(1, seqs, to_wire(np.zeros(n, np.int32)), to_wire(np.zeros(n, np.int32)), to_wire(np.zeros((n, 1), np.int32)))


def test_parameters_come_once_and_are_found_by_slot_until_another_request_takes_it():
    table = SlotParams()
    assert table.resolve(step(StepSeq("a", 0, 4, 4, True, GREEDY, slot=0), StepSeq("b", 4, 2, 2, True, HOT, slot=1))) == [GREEDY, HOT]
    assert table.resolve(step(StepSeq("b", 0, 1, 3, True, slot=1), StepSeq("a", 1, 1, 5, True, slot=0))) == [HOT, GREEDY]
    assert table.resolve(step(StepSeq("c", 0, 3, 3, True, HOT, slot=0))) == [HOT]  # a took slot 0 before; c now
    with pytest.raises(StaleStep, match="request a's slot 0"):
        table.resolve(step(StepSeq("a", 0, 1, 6, True, slot=0)))
    assert table.resolve(step(StepSeq("x", 0, 2, 2, True, GREEDY))) == [GREEDY]  # no slot: it always brings them


def test_a_step_for_an_earlier_worker_is_stale():
    with pytest.raises(StaleStep, match="planned for an earlier worker"):
        SlotParams().resolve(step(StepSeq("gone", 0, 1, 9, True, slot=3)))
