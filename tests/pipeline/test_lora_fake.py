"""LoRA adapters through the whole stack with the fake worker: loaded and unloaded at run time in
vLLM's and SGLang's dialects, named by OpenAI's `model` and SGLang's `lora_path`, listed by
/v1/models, kept apart in the prefix cache, pushed by a trainer with a weight version, and every
bad input refused by name. The fake model adds an adapter's rank to every prediction
(worker_svc/fake.py): next token = last + 1 + rank, so a token tells which adapter computed it."""

import json

import httpx
import numpy as np
import openai
import pytest

from jaxstream import rl
from jaxstream.safetensors import encode
from tests.support import serve

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def stack(redis_url):
    yield from serve(redis_url, "worker=fake", "worker.lora.max_adapters=2", "worker.lora.max_rank=8")


def peft_dir(root, name: str, rank: int):
    """A directory the fake reads as a PEFT adapter of rank `rank`."""
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"]}))
    (path / "adapter_model.safetensors").write_bytes(encode({}))
    return str(path)


def post(stack: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(stack + route, json=body, timeout=30)


def tokens(stack: str, prompt: list[int], **fields) -> tuple[list[int], dict]:
    reply = httpx.post(stack + "/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 3}, **fields},
                       timeout=30).json()
    return reply["output_ids"], reply["meta_info"]


def test_load_name_list_and_unload_an_adapter_at_run_time(stack, client, tmp_path):
    path = peft_dir(tmp_path, "three", 3)
    loaded = post(stack, "/v1/load_lora_adapter", {"lora_name": "three", "lora_path": path})
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'three' added successfully.")
    cards = {m.id: m for m in client.models.list().data}
    assert cards["three"].parent == MODEL and cards["three"].root == path and cards[MODEL].parent is None
    r = client.completions.create(model="three", prompt=[100, 200], max_tokens=3)
    assert r.model == "three" and r.choices[0].text is not None
    assert tokens(stack, [100, 200], lora_path="three")[0] == [204, 208, 212]  # last + 1 + 3
    assert tokens(stack, [100, 200])[0] == [201, 202, 203]  # the base model beside it
    batch = httpx.post(stack + "/generate", json={"input_ids": [[10], [20]], "lora_path": ["three", None],
                                                  "sampling_params": {"max_new_tokens": 2}}, timeout=30).json()
    assert [b["output_ids"] for b in batch] == [[14, 18], [21, 22]]  # one adapter per prompt
    again = post(stack, "/v1/load_lora_adapter", {"lora_name": "three", "lora_path": path})
    assert again.status_code == 400 and again.json()["error"]["message"] == "The lora adapter 'three' has already been loaded."
    gone = post(stack, "/v1/unload_lora_adapter", {"lora_name": "three"})
    assert (gone.status_code, gone.text) == (200, "Success: LoRA adapter 'three' removed successfully.")
    assert "three" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError, match="The model `three` does not exist."):
        client.completions.create(model="three", prompt=[100, 200], max_tokens=3)


def test_a_prefix_cached_under_one_adapter_is_never_reused_under_another(stack, tmp_path):
    for name, rank in (("one", 1), ("two", 2)):
        assert post(stack, "/load_lora_adapter", {"lora_name": name, "lora_path": peft_dir(tmp_path, name, rank)}).json()["success"]
    try:
        prompt = list(range(3000, 3040))  # 40 tokens: two whole pages
        assert [tokens(stack, prompt)[1]["cached_tokens"] for _ in range(2)] == [0, 32]  # the base model's, then its own again
        assert tokens(stack, prompt, lora_path="one")[1]["cached_tokens"] == 0  # not the base model's KV
        assert tokens(stack, prompt, lora_path="one")[1]["cached_tokens"] == 32  # its own
        out, meta = tokens(stack, prompt, lora_path="two")
        assert meta["cached_tokens"] == 0 and out == [3042, 3045, 3048]  # not adapter one's
        full = post(stack, "/v1/load_lora_adapter", {"lora_name": "three", "lora_path": peft_dir(tmp_path, "three", 3)})
        assert full.status_code == 400  # the replica named once, though the scheduler's refusal names it itself
        assert full.json()["error"]["message"].startswith("replica 0: too many adapters: worker.lora.max_adapters is 2")
    finally:
        for name in ("one", "two"):
            reply = post(stack, "/unload_lora_adapter", {"lora_name": name}).json()
            assert reply["success"] and name not in reply["loaded_adapters"]


@pytest.mark.parametrize(("route", "body", "status", "message"), [
    ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/dir"}, 400, "not a PEFT directory"),
    ("/v1/load_lora_adapter", {"lora_name": MODEL, "lora_path": "/x"}, 400, "is the base model's name"),
    ("/v1/unload_lora_adapter", {"lora_name": "x"}, 404, "The lora adapter 'x' cannot be found."),
    ("/unload_lora_adapter", {"lora_name": "x"}, 404, "The lora adapter 'x' cannot be found."),
    ("/v1/completions", {"model": "x", "prompt": "hi"}, 404, "The model `x` does not exist."),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "lora_path": "x"}, 400,
     "'lora_path' names no loaded LoRA adapter: 'x'"),
    ("/generate", {"input_ids": [[1], [2]], "lora_path": ["x"]}, 400, "gives 1 adapter for 2 prompts"),
])
def test_bad_input_is_refused_by_name(stack, route, body, status, message):
    reply = post(stack, route, body)
    assert reply.status_code == status and message in reply.json()["error"]["message"], reply.text


def test_a_pushed_adapter_serves_with_its_weight_version(stack, tmp_path):
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    tensors = {name.format("A"): np.ones((4, 8), np.float32), name.format("B"): np.zeros((8, 4), np.float32)}
    reply = rl.push_adapter(stack, "pushed", tensors, rank=4, alpha=8, target_modules=["q_proj"], weight_version="lora-1",
                            bucket_bytes=128)  # two buckets
    assert reply["success"] and reply["loaded_adapters"] == {"pushed": ""}
    try:
        out, meta = tokens(stack, [50], lora_path="pushed")
        assert out == [55, 60, 65] and meta["weight_version"] == "lora-1"
        again = rl.push_adapter(stack, "pushed", tensors, rank=6, alpha=8, target_modules=["q_proj"], weight_version="lora-2")
        assert again["success"]  # the same name: replaced
        out, meta = tokens(stack, [50], lora_path="pushed")
        assert out == [57, 64, 71] and meta["weight_version"] == "lora-2"
        with pytest.raises(rl.WeightPushError, match="HTTP 400: 'r' must be the adapter's rank"):
            rl.push_adapter(stack, "pushed", tensors, rank=0, alpha=8, target_modules=["q_proj"])
    finally:
        assert post(stack, "/v1/unload_lora_adapter", {"lora_name": "pushed"}).status_code == 200
