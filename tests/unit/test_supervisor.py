"""`jaxstream up`'s restart policy (stack/supervisor.py): units, back-off, crash loops."""

import pytest

from stack.supervisor import CrashLoop, Restarts, unit_of


def test_a_replicas_scheduler_and_worker_are_one_unit_every_other_child_its_own():
    assert unit_of("scheduler") == unit_of("worker") == "replica 0"
    assert unit_of("scheduler.1") == unit_of("worker.1") == "replica 1" != unit_of("worker.0")
    assert [unit_of(n) for n in ("gateway", "tokenizer", "detokenizer", "redis")] == ["gateway", "tokenizer", "detokenizer", "redis"]


def test_restarts_back_off_and_a_crash_loop_within_the_window_stops():
    restarts = Restarts(max_restarts=3, window_s=60)
    assert [restarts.died("worker", t) for t in (0, 1, 2)] == [0.5, 1.0, 2.0]
    assert restarts.died("tokenizer", 3) == 0.5  # counted per unit
    with pytest.raises(CrashLoop, match="worker died 4 times within 60 s"):
        restarts.died("worker", 4)


def test_deaths_older_than_the_window_are_forgotten():
    restarts = Restarts(max_restarts=2, window_s=10)
    restarts.died("gateway", 0)
    restarts.died("gateway", 5)
    assert restarts.died("gateway", 12) == 1.0  # the death at 0 left the window
    assert restarts.died("gateway", 30) == 0.5
