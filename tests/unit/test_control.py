"""Pause, continue, weight updates and memory release through the scheduler service, the fake
worker's DeviceControl and the detokenizer, in one process (test_fake_pipeline's Pipeline).

The fake model predicts last + 1 + shift; a tensor update pushes `shift`, so which weights
computed a token can be read off the token itself."""

import numpy as np
import pytest

from jaxstream import protocol
from jaxstream.safetensors import encode
from scheduler_svc.service import Outbox
from stack.driver import INBOX, wire
from tests.unit.test_fake_pipeline import Pipeline


def started(tokenizer_info, requests=3, max_new=20, **kwargs) -> Pipeline:
    p = Pipeline(tokenizer_info.tokenizer, **kwargs)
    for i in range(requests):
        p.submit(f"r{i}", [1000 * (i + 1)], max_new=max_new)
    p.run(max_steps=6, settle=False)  # mid-generation
    assert all(0 < len(p.tokens(f"r{i}")) < max_new for i in range(requests))
    return p


def reply(p: Pipeline, rid: str) -> protocol.ControlReply:
    (answer,) = [r for r in p.replies if r.rid == rid]
    return answer


def push_shift(p: Pipeline, value: int, rid: str = "stage") -> None:
    p.blobs["k:0"] = encode({"shift": np.array(value, np.int64)})
    p.ask(protocol.UpdateWeights(rid, "gw", "stage", blobs=("k:0",)))


def assert_counts_up(tokens: list[int], first: int, shift_from: int | None = None, shift: int = 0) -> None:
    """Tokens after `first`: + 1 each, + 1 + shift from index `shift_from` on."""
    expected, last = [], first
    for i in range(len(tokens)):
        last += 1 + (shift if shift_from is not None and i >= shift_from else 0)
        expected.append(last)
    assert tokens == expected


def test_in_place_pause_freezes_requests_and_continue_completes_them(tokenizer_info):
    p = started(tokenizer_info)
    p.ask(protocol.PauseGeneration("p", "gw", "in_place"))
    p.run(max_steps=50)  # settles: nothing is stepped while paused
    frozen = {rid: len(p.tokens(rid)) for rid in ("r0", "r1", "r2")}
    assert reply(p, "p").ok and reply(p, "p").requests == 3
    assert p.scheduler.core.stats()["running"] == 3
    p.ask(protocol.ContinueGeneration("c", "gw"))
    p.run()
    for i, rid in enumerate(("r0", "r1", "r2")):
        assert frozen[rid] < 20
        assert_counts_up(p.tokens(rid), 1000 * (i + 1))
        assert p.finish(rid).type == "length"
    assert p.scheduler.core.check_idle() is None


def test_retract_pause_frees_the_kv_lets_the_cache_flush_and_recomputes_on_continue(tokenizer_info):
    p = started(tokenizer_info, cache=True)
    p.ask(protocol.PauseGeneration("p", "gw", "retract"))
    p.run(max_steps=50)
    core = p.scheduler.core
    assert core.stats()["running"] == 0 and core.stats()["waiting"] == 3
    assert p.scheduler.flush_cache("f").flushed  # waiting requests hold no page while paused
    assert core.allocator.num_used == 0
    p.ask(protocol.ContinueGeneration("c", "gw"))
    p.run()
    for i, rid in enumerate(("r0", "r1", "r2")):
        assert_counts_up(p.tokens(rid), 1000 * (i + 1))
        assert len(p.tokens(rid)) == 20
    assert core.check_idle() is None


def test_abort_pause_ends_every_request_with_its_partial_output(tokenizer_info):
    p = started(tokenizer_info)
    p.ask(protocol.PauseGeneration("p", "gw", "abort"))
    p.run(max_steps=50)
    assert reply(p, "p").requests == 3
    for i, rid in enumerate(("r0", "r1", "r2")):
        assert p.finish(rid).type == "abort"
        assert 0 < len(p.tokens(rid)) < 20
        assert_counts_up(p.tokens(rid), 1000 * (i + 1))
    p.submit("late", [7000], max_new=3)  # arrives while paused: waits in the scheduler
    p.run(max_steps=20)
    assert "late" not in p.outputs
    p.ask(protocol.ContinueGeneration("c", "gw"))
    p.run()
    assert p.tokens("late") == [7001, 7002, 7003]


def test_an_update_drains_running_requests_then_later_ones_use_the_new_weights(tokenizer_info):
    p = started(tokenizer_info, requests=2, max_running=2)
    p.submit("after", [9000], max_new=4)  # waits: both slots are taken
    push_shift(p, 2)
    p.ask(protocol.UpdateWeights("commit", "gw", "commit", version="v2"))
    p.run()
    assert reply(p, "stage").ok and reply(p, "commit").ok and reply(p, "commit").weight_version == "v2"
    for i, rid in enumerate(("r0", "r1")):  # ran to their end on the old weights
        assert_counts_up(p.tokens(rid), 1000 * (i + 1))
        assert {o.weight_version for o in p.outputs[rid] if o.token_ids} == {"default"}
    assert p.tokens("after") == [9003, 9006, 9009, 9012]
    assert {o.weight_version for o in p.outputs["after"] if o.token_ids} == {"v2"}


def test_pause_update_continue_switches_weights_mid_request(tokenizer_info):
    p = started(tokenizer_info)
    p.ask(protocol.PauseGeneration("p", "gw", "in_place"))
    p.run()
    before = {rid: len(p.tokens(rid)) for rid in ("r0", "r1", "r2")}
    push_shift(p, 1)
    p.ask(protocol.UpdateWeights("commit", "gw", "commit", version="v2"))
    p.run()
    assert reply(p, "commit").ok
    p.ask(protocol.ContinueGeneration("c", "gw"))
    p.run()
    for i, rid in enumerate(("r0", "r1", "r2")):
        # The token in flight when the pause came may be the old weights'; every step after the swap is the new ones'.
        versions = [o.weight_version for o in p.outputs[rid] for _ in o.token_ids]
        switch = versions.index("v2")
        assert switch >= before[rid] and set(versions[switch:]) == {"v2"} and set(versions[:switch]) == {"default"}
        assert_counts_up(p.tokens(rid), 1000 * (i + 1), shift_from=switch, shift=1)
        assert len(p.tokens(rid)) == 20
    assert p.scheduler.core.check_idle() is None


@pytest.mark.parametrize("tensors,named", [({"shift": np.zeros(3, np.int64)}, "shift"), ({"bias": np.array(1)}, "bias")])
def test_a_bad_tensor_is_refused_by_name_and_the_old_weights_keep_serving(tokenizer_info, tensors, named):
    p = started(tokenizer_info, requests=1)
    p.blobs["k:0"] = encode(tensors)
    p.ask(protocol.UpdateWeights("stage", "gw", "stage", blobs=("k:0",)))
    p.run()
    answer = reply(p, "stage")
    assert not answer.ok and named in answer.message
    assert p.worker.staged is None and p.worker.shift == 0
    assert_counts_up(p.tokens("r0"), 1000)


def test_a_version_only_commit_sets_the_version(tokenizer_info):
    p = Pipeline(tokenizer_info.tokenizer)
    p.ask(protocol.UpdateWeights("v", "gw", "commit", version="step-7"))
    p.submit("r", [100], max_new=2)
    p.run()
    assert reply(p, "v").ok and reply(p, "v").weight_version == "step-7"
    assert p.tokens("r") == [101, 102] and {o.weight_version for o in p.outputs["r"] if o.token_ids} == {"step-7"}


def test_memory_release_needs_a_quiet_replica_and_resume_awaits_the_weights_values(tokenizer_info):
    p = started(tokenizer_info, requests=1)
    p.ask(protocol.Memory("busy", "gw", True))
    p.run()  # the request finishes meanwhile
    assert not reply(p, "busy").ok and "running" in reply(p, "busy").message
    p.ask(protocol.Memory("rel", "gw", True))
    p.run()
    assert reply(p, "rel").ok and p.worker.released == {"weights", "kv_cache"}
    p.submit("waits", [300], max_new=2)
    p.run()
    assert "waits" not in p.outputs  # nothing steps while released
    p.ask(protocol.Memory("res", "gw", False))
    p.run()
    assert reply(p, "res").ok and "awaited" in reply(p, "res").message and p.worker.released == {"weights"}
    assert "waits" not in p.outputs  # nothing steps until the weights' values come
    p.submit("new", [400], max_new=1)
    p.run()
    assert [(r.rid, r.status) for r in p.rejected] == [("new", 503)] and "push them" in p.rejected[0].message
    p.ask(protocol.UpdateWeights("renamed", "gw", "commit", version="named"))  # a version alone brings no value
    p.run()
    assert reply(p, "renamed").ok and "waits" not in p.outputs
    push_shift(p, 2)
    p.ask(protocol.UpdateWeights("commit", "gw", "commit", version="pushed"))
    p.run()
    assert reply(p, "commit").ok and not p.worker.released
    assert p.tokens("waits") == [303, 306]  # on the pushed weights


def test_a_worker_that_stops_fails_what_it_was_asked_and_what_waited_for_it(tokenizer_info):
    p = started(tokenizer_info, requests=1)
    push_shift(p, 1)
    p.ask(protocol.UpdateWeights("commit", "gw", "commit", version="v2"))
    out = Outbox()
    p.scheduler.take([wire(m, INBOX) for m in p.inbox], out)  # relayed, not answered yet
    p.inbox = []
    assert "stage" in p.scheduler.control.sent and p.scheduler.control.waiting
    p.scheduler.worker_lost(out)
    failed = {r.rid: r for _, r in out.replies if isinstance(r, protocol.ControlReply)}
    assert set(failed) == {"stage", "commit"} and not any(r.ok for r in failed.values())
    assert all("worker stopped" in r.message for r in failed.values())
    p.scheduler.control.worker_up = False  # as Peers sees it until a new worker beats
    late = Outbox()
    p.scheduler.take([protocol.UpdateWeights("again", "gw", "stage", path="/x")], late)
    assert [(r.rid, r.ok) for _, r in late.replies] == [("again", False)] and not late.to_worker
