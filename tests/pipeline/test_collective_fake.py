"""Collective weight sync through a whole stack with the fake worker and two data-parallel replicas:
a trainer process (plain torch.distributed, gloo; examples/collective_sync.py) makes a group that
both replicas' workers join, one rank each, and broadcasts the fake model's one weight, `shift`, in
SGLang's dialect, xorl's two-phase one and vLLM's; both replicas swap it in. A bucket naming a
tensor the model lacks is received whole and refused; a trainer that dies mid-bucket fails the
update, changes nothing and costs the group; bad requests are 400s naming the field.

The fake model predicts last + 1 + shift (worker_svc/fake.py): a token tells which weights computed it."""

import json
import subprocess
import sys
import threading

import httpx
import pytest

from tests.support import ROOT, serve

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]

TRAINER = """
import json, sys, httpx, torch
from examples.collective_sync import CollectiveTrainer
base = sys.argv[1]
def generate(first):
    body = {"input_ids": [first], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    out = httpx.post(base + "/generate", json=body, timeout=60).json()
    return out["output_ids"], out["meta_info"]["weight_version"]
def post(route, body):
    r = httpx.post(base + route, json=body, timeout=60)
    return r.status_code, r.json()
"""


def trainer(base: str, code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TRAINER + code, base], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def results(proc: subprocess.Popen) -> list:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    return [json.loads(line) for line in out.splitlines()]


@pytest.fixture(scope="module")
def stack(redis_url):
    yield from serve(redis_url, "worker=fake", "parallelism=dp2")


def worker_versions(base: str) -> list[str]:
    return sorted(s["weight_version"] for s in httpx.get(base + "/stats", timeout=10).json()["worker"].values())


def test_each_dialect_swaps_the_broadcast_weight_into_both_replicas(stack):
    proc = trainer(stack, """
with CollectiveTrainer(base) as t:
    print(json.dumps(t.join()))
    # a bucket naming a tensor the model lacks: received whole (the broadcast ends), refused, nothing swapped
    answer = t._post_later("/update_weights_from_distributed", {"names": ["shift", "nope"], "dtypes": ["int64", "float32"],
                                                                "shapes": [[], [1]], "weight_version": "bad"})
    t._broadcast([torch.tensor(9), torch.ones(1)])
    try:
        answer.result()
    except RuntimeError as e:
        print(json.dumps(str(e)))
    print(json.dumps([generate(10), generate(20)]))
for dialect, shift in (("sglang", 3), ("two-phase", 5), ("vllm", 7)):
    with CollectiveTrainer(base, dialect=dialect) as t:
        t.join()
        t.send({"shift": torch.tensor(shift)}, weight_version=dialect)
    print(json.dumps([generate(10), generate(20)]))
""")
    joined, refused, before, *after = results(proc)
    assert joined["success"] and "replica 0: joined group 'weight_update_group' as rank 1 of 3" in joined["message"]
    assert "replica 1: joined group 'weight_update_group' as rank 2 of 3 (gloo" in joined["message"]
    assert "HTTP 400" in refused and "no parameter reads tensor 'nope'" in refused and '"success":false' in refused
    assert before == [[[11, 12, 13], "default"], [[21, 22, 23], "default"]]  # the staging was dropped
    for (dialect, shift), outputs in zip((("sglang", 3), ("two-phase", 5), ("vllm", 7)), after):
        assert outputs == [[[11 + shift, 12 + 2 * shift, 13 + 3 * shift], dialect], [[21 + shift, 22 + 2 * shift, 23 + 3 * shift], dialect]]
    assert worker_versions(stack) == ["vllm", "vllm"]  # both replicas swapped


def test_a_trainer_that_dies_mid_bucket_fails_the_update_and_changes_nothing(stack):
    before = worker_versions(stack)
    proc = trainer(stack, """
import os
t = CollectiveTrainer(base, group_name="doomed")
print(json.dumps(t.join()), flush=True)
sys.stdin.readline()  # the test has asked for the bucket
torch.distributed.broadcast(torch.tensor(4), src=0, group=t.pg)
os._exit(0)  # before the bucket's second tensor
""")
    assert json.loads(proc.stdout.readline())["success"]
    box = {}
    body = {"names": ["shift", "shift"], "dtypes": ["int64", "int64"], "shapes": [[], []], "group_name": "doomed",
            "weight_version": "never"}
    ask = threading.Thread(target=lambda: box.setdefault("r", httpx.post(stack + "/update_weights_from_distributed", json=body, timeout=120)))
    ask.start()
    proc.stdin.write("go\n")
    proc.stdin.flush()
    ask.join(120)
    proc.wait(60)
    answer = box["r"].json()
    assert box["r"].status_code == 400 and answer["success"] is False
    assert "receiving 'shift' in group 'doomed' failed" in answer["message"], answer
    assert worker_versions(stack) == before
    gone = httpx.post(stack + "/destroy_weights_update_group", json={"group_name": "doomed"}, timeout=30)
    assert gone.status_code == 400 and "no group 'doomed' here" in gone.json()["message"]  # forgotten: an init starts afresh


@pytest.mark.parametrize("route,body,field", [
    ("/init_weights_update_group", {"master_port": 5, "rank_offset": 1, "world_size": 3}, "master_address"),
    ("/init_weights_update_group", {"master_address": "h", "master_port": 0, "rank_offset": 1, "world_size": 3}, "master_port"),
    ("/init_weights_update_group", {"master_address": "h", "master_port": 5, "rank_offset": 0, "world_size": 3}, "rank_offset"),
    ("/init_weights_update_group", {"master_address": "h", "master_port": 5, "rank_offset": 1, "world_size": 2}, "world_size"),
    ("/init_weights_update_group", {"master_address": "h", "master_port": 5, "rank_offset": 1, "world_size": 3, "backend": "mpi"}, "backend"),
    ("/update_weights_from_distributed", {"names": ["shift"], "dtypes": ["complex64"], "shapes": [[]]}, "dtypes[0]"),
    ("/update_weights_from_distributed", {"names": ["shift"], "dtypes": ["int64", "int64"], "shapes": [[]]}, "dtypes"),
    ("/update_weights_from_distributed", {"names": ["shift"], "dtypes": ["int64"], "shapes": [[2]]}, "shapes[0]"),
    ("/update_weights_from_distributed", {"name": "shift", "dtype": "int64", "shape": [-1]}, "shape"),
    ("/update_weights_from_distributed", {"names": ["shift"], "dtypes": ["int64"], "shapes": [[]], "load_format": "direct"}, "load_format"),
    ("/prepare_weights_update", {"names": ["shift"], "dtypes": ["int64"], "shapes": [[]], "transport": "p2p"}, "transport"),
    ("/init_weight_transfer_engine", {"init_info": {"master_address": "h", "master_port": 5, "rank_offset": 1}}, "init_info.world_size"),
    ("/update_weights", {"update_info": {"names": ["shift"], "dtype_names": ["int64"], "shapes": [[]], "packed": True,
                                         "packed_buffer_size_bytes": 0}}, "update_info.packed_buffer_size_bytes"),
    ("/update_weights", {}, "update_info"),
    ("/start_weight_update", {"is_checkpoint_format": False}, "is_checkpoint_format"),
])
def test_a_bad_request_is_refused_naming_the_field(stack, route, body, field):
    response = httpx.post(stack + route, json=body, timeout=30)
    answer = response.json()
    assert response.status_code == 400 and answer["success"] is False and answer["error"]["param"] == field, answer
    assert f"'{field}'" in answer["message"]


def test_a_bucket_for_a_group_never_joined_is_refused_by_each_replica(stack):
    body = {"names": ["shift"], "dtypes": ["int64"], "shapes": [[]], "group_name": "nobody"}
    response = httpx.post(stack + "/update_weights_from_distributed", json=body, timeout=30)
    message = response.json()["message"]
    assert response.status_code == 400 and "replica 0: no group 'nobody' here" in message and "replica 1: no group" in message
