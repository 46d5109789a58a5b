"""LoRA adapters in the scheduler, without Redis: the registry's slots and generations
(scheduler_svc/adapters.py), the prefix cache keyed by the adapter's generation (radix.py), a load
relayed to the worker with its slot and placed once answered, an unload whose slot drains, and a
request's slot sent once per admission (StepSeq.adapter)."""

import pytest

from jaxstream import protocol
from scheduler_svc.adapters import BASE, AdapterRegistry, UnknownAdapter
from scheduler_svc.core import Scheduler
from scheduler_svc.pages import PageAllocator
from scheduler_svc.radix import RadixCache
from scheduler_svc.service import Outbox, SchedulerService


def test_a_load_takes_a_free_slot_and_a_new_generation_and_a_reload_drains_the_old_slot():
    registry = AdapterRegistry(3, {"start": (0, "/a/start")})
    assert registry.resolve("") == (BASE, 0) and registry.resolve("start") == (0, 1)
    slot = registry.reserve("math", in_use=set())
    assert slot == 1 and registry.resolve("start") == (0, 1)
    with pytest.raises(UnknownAdapter, match="The model `math` does not exist."):
        registry.resolve("math")  # not until the worker answered
    assert registry.loaded(slot, "/a/math").generation == 2 and registry.resolve("math") == (1, 2)
    assert registry.reserve("math", in_use={1}) == 2  # reloaded beside the live slot, which requests read
    registry.loaded(2, "/a/math2")
    assert registry.resolve("math") == (2, 3) and registry.draining == {1}
    registry.sweep(in_use={1})
    assert registry.draining == {1}  # still read
    registry.sweep(in_use=set())
    assert registry.draining == set()


def test_no_free_slot_is_too_many_adapters_unless_the_name_own_slot_is_unread():
    registry = AdapterRegistry(1)
    registry.loaded(registry.reserve("a", set()), "")
    assert registry.reserve("a", in_use=set()) == 0  # rewritten in place: nothing reads it
    registry.failed(0)
    with pytest.raises(ValueError, match=r"too many adapters: worker.lora.max_adapters is 1 .*loaded: a"):
        registry.reserve("b", in_use=set())
    with pytest.raises(ValueError, match="too many adapters"):
        registry.reserve("a", in_use={0})
    with pytest.raises(ValueError, match="no adapter slots: set worker.lora.max_adapters"):
        AdapterRegistry(0).reserve("a", set())


def test_an_unload_refuses_the_name_at_once_and_a_reset_keeps_the_start_adapters():
    registry = AdapterRegistry(2, {"start": (0, "/s")})
    registry.loaded(registry.reserve("x", set()), "/x")
    assert registry.unload("x").slot == 1 and registry.draining == {1}
    with pytest.raises(UnknownAdapter):
        registry.resolve("x")
    with pytest.raises(UnknownAdapter):
        registry.unload("x")
    registry.reset()  # a new worker: the start adapters alone, under new generations
    assert set(registry.live) == {"start"} and registry.resolve("start")[1] > 2 and not registry.draining


def test_the_prefix_cache_matches_a_path_only_under_the_namespace_it_was_inserted_under():
    pages = PageAllocator(8)
    cache = RadixCache(2, pages)
    tokens = [5, 6, 7, 8]
    cache.insert(tokens, pages.allocate(2), namespace=3)
    assert cache.match(tokens)[1] == [] and cache.match(tokens, namespace=4)[1] == []
    assert len(cache.match(tokens, namespace=3)[1]) == 2
    cache.insert(tokens, pages.allocate(2))  # the base model's own copy
    assert len(cache.match(tokens)[1]) == 2 and cache.num_pages == 4


def service(adapters: AdapterRegistry) -> SchedulerService:
    pages = PageAllocator(32)
    core = Scheduler(max_running=4, token_budget=32, page_size=4, allocator=pages, cache=RadixCache(4, pages))
    svc = SchedulerService(core, overlap=False, adapters=adapters)
    svc.detokenizers = ["detokenizer.one"]
    return svc


def request(rid: str, lora: str = "") -> protocol.TokenizedRequest:
    return protocol.TokenizedRequest(rid, "gw", (1, 2, 3), protocol.SamplingParams(max_new_tokens=3, lora=lora),
                                     protocol.FinishRule((2,), 3))


def test_a_request_names_its_adapter_once_per_admission_and_an_unknown_one_is_a_404():
    svc = service(AdapterRegistry(2, {"math": (1, "/m")}))
    out = Outbox()
    svc.take([request("a", "math"), request("b"), request("c", "nope")], out)
    assert out.replies == [("gw", protocol.RequestRejected("c", 404, "The model `nope` does not exist.", "model", "model_not_found"))]
    first, second = Outbox(), Outbox()
    svc.plan(first)
    (step,) = first.steps
    assert [(s.rid, s.adapter) for s in step.seqs] == [("a", 1), ("b", -1)]
    svc.take([protocol.StepResult(step.step_id, ("a", "b"), (7, 7), (-0.5, -0.5))], Outbox())
    svc.plan(second)
    assert [s.adapter for s in second.steps[0].seqs] == [-1, -1]  # kept by slot on the worker: sent once


def test_a_load_goes_to_the_worker_with_its_slot_and_the_name_serves_once_answered():
    svc = service(AdapterRegistry(2))
    out = Outbox()
    svc.take([protocol.LoadAdapter("l", "gw", "math", "/m")], out)
    (sent,) = out.to_worker
    assert (sent.name, sent.slot) == ("math", 0) and svc.control.adapters.reserved == {0: "math"}
    answered = Outbox()
    svc.take([protocol.ControlReply("l", True, "written")], answered)
    assert answered.replies == [("gw", protocol.ControlReply("l", True, "written"))]
    assert svc.control.adapters.resolve("math") == (0, 1)
    svc.take([request("a", "math")], Outbox())
    unloaded = Outbox()
    svc.take([protocol.UnloadAdapter("u", "gw", "math")], unloaded)
    assert unloaded.replies[0][1].message == "replica 0: adapter 'math' unloaded; its slot is freed once the requests under it end (1 now)"
    svc.take([protocol.LoadAdapter("l2", "gw", "other", "/o")], out := Outbox())
    assert out.to_worker[0].slot == 1  # slot 0 drains while request a runs under it
    svc.take([protocol.ControlReply("l2", False, "rank 64 is above worker.lora.max_rank 8")], Outbox())
    assert svc.control.adapters.reserved == {} and "other" not in svc.control.adapters.live
