"""Data-parallel replicas without Redis: the gateway's choice of replica, health's names for what is
missing, the processes `jaxstream up` starts, and the replica a stop string's finish goes back to."""

from detokenizer_svc.service import Detokenizer
from gateway.replicas import Replicas
from gateway.watchdog import missing_roles, up_replicas
from jaxstream import protocol
from jaxstream.config import load_config
from stack.launcher import Stack
from jaxstream.names import Keys, replica_of, role_of
from scheduler_svc.core import Scheduler
from scheduler_svc.pages import PageAllocator
from scheduler_svc.service import Outbox, SchedulerService

BOTH = (0, 1)


def test_an_idle_stack_spreads_requests_in_turn():
    replicas = Replicas(3)
    assert [replicas.assign(f"r{i}", range(3)) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert replicas.in_flight == [2, 2, 2]


def test_a_request_goes_to_the_replica_with_fewest_in_flight():
    replicas = Replicas(2)
    replicas.assign("a", BOTH)  # 0
    replicas.assign("b", BOTH)  # 1
    replicas.assign("c", BOTH)  # 0 again: a tie, and the turn is 0's
    replicas.release("b")
    assert replicas.in_flight == [2, 0]
    assert [replicas.assign(rid, BOTH) for rid in ("d", "e")] == [1, 1]  # 1 has fewer until they are even
    assert replicas.assign("f", BOTH) == 0  # even again: the turn moves on from 1
    replicas.release("unknown")  # a request that never ran here changes nothing
    assert replicas.in_flight == [3, 2]


def test_only_live_replicas_are_chosen_and_requests_are_found_by_rid():
    replicas = Replicas(2)
    assert [replicas.assign(f"r{i}", [1]) for i in range(3)] == [1, 1, 1]  # replica 0 is down
    assert replicas.assign("x", BOTH) == 0
    assert replicas.replica_of("r2") == 1 and replicas.replica_of("x") == 0 and replicas.replica_of("nope") is None
    assert sorted(replicas.rids_on([1])) == ["r0", "r1", "r2"] and replicas.rids_on([]) == []
    replicas.release("r1")
    assert replicas.replica_of("r1") is None and replicas.in_flight == [1, 2]


def test_instance_names_and_streams_carry_the_replica():
    assert (role_of("worker.1.ab12cd34"), replica_of("worker.1.ab12cd34")) == ("worker", 1)
    assert replica_of("tokenizer.ab12cd34") is None and replica_of("scheduler.0.ab12cd34") == 0
    keys = Keys("ns")
    streams = {keys.scheduler(0), keys.scheduler(1), keys.worker(0), keys.worker(1), keys.results(0), keys.results(1)}
    assert len(streams) == 6 and keys.scheduler(1) == "ns:stream:scheduler:1"


def test_health_names_each_replicas_missing_scheduler_and_worker():
    live = ["gateway.g", "tokenizer.t", "detokenizer.d", "scheduler.0.a", "worker.0.b", "scheduler.1.c"]
    assert missing_roles(live, 2) == ["worker.1"]
    assert up_replicas(missing_roles(live, 2), 2) == [0]
    assert missing_roles(live[:3], 2) == ["scheduler.0", "scheduler.1", "worker.0", "worker.1"]
    assert up_replicas(missing_roles(live[:3], 2), 2) == []
    # One replica: the roles plainly, as before replicas existed.
    assert missing_roles(["tokenizer.t", "scheduler.0.a"], 1) == ["worker", "detokenizer"]
    assert up_replicas(["worker", "detokenizer"], 1) == [] and up_replicas(["detokenizer"], 1) == [0]


def test_up_starts_a_scheduler_and_a_worker_per_replica():
    stack = Stack(load_config(["parallelism=dp2", "worker=fake"]), [])
    assert [(name, extra) for name, _, extra in stack.processes()] == [
        ("gateway", []), ("tokenizer", []),
        ("scheduler.0", ["parallelism.replica=0"]), ("scheduler.1", ["parallelism.replica=1"]),
        ("worker.0", ["parallelism.replica=0"]), ("worker.1", ["parallelism.replica=1"]),
        ("detokenizer", []),
    ]
    single = Stack(load_config([]), [])
    assert [name for name, _, _ in single.processes()] == ["gateway", "tokenizer", "scheduler", "worker", "detokenizer"]


def test_a_stop_string_finish_goes_back_to_the_replica_that_runs_the_request(tokenizer_info):
    tok = tokenizer_info.tokenizer
    stop = tok.decode([5003]).strip()
    starts = []
    for replica in BOTH:  # each replica's scheduler names itself in the start it sends
        core = Scheduler(max_running=4, token_budget=16, page_size=4, allocator=PageAllocator(8))
        service = SchedulerService(core, replica)
        service.detokenizers = ["detokenizer.one"]
        out = Outbox()
        sampling = protocol.SamplingParams(max_new_tokens=50, stop=(stop,))
        service.take([protocol.TokenizedRequest(f"on{replica}", "gw", (5000,), sampling, finish=protocol.FinishRule((), 50))], out)
        starts += out.started["detokenizer.one"]
    assert [s.replica for s in starts] == [0, 1]
    detok = Detokenizer(tok)
    detok.step([protocol.RequestEvents(started=tuple(starts))])
    stopped = {}
    for step, token in enumerate((5001, 5002, 5003, 5004)):  # each replica's worker: its own step ids
        results = [protocol.StepResult(starts[r].first_step + step, (f"on{r}",), (token,), (0.0,), replica=r) for r in BOTH]
        _, stopped_now = detok.step(results)
        for replica, rids in stopped_now.items():
            stopped.setdefault(replica, []).extend(rids)
    assert stopped == {0: ["on0"], 1: ["on1"]}
