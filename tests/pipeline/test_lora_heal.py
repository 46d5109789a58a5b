"""LoRA adapters heal (docs/operations.md, failures): services as separate processes with the fake
worker (as compose runs them; `jaxstream up` restarts a replica's scheduler and worker together,
which is the new scheduler's case below), each restarted in turn. After each restart /v1/models
lists exactly the adapters a request may name, and a request by name answers as that adapter (the
fake adds an adapter's rank to every prediction: a token tells which adapter computed it):

- a new worker gets back the adapters loaded from a path at run time; a pushed one is gone (404),
  until the trainer pushes it again;
- a new scheduler restores the path entries of the names every gateway reads, dropping the pushed;
- after a Redis restart the schedulers write every name of their registries again, pushed ones too
  (the workers still hold them)."""

import json

import httpx
import numpy as np
import pytest

from jaxstream import rl
from jaxstream.redis_server import EmbeddedRedis, free_port
from jaxstream.safetensors import encode
from tests.support import assert_idle, healthy, stack_overrides, start_service, wait_for

pytestmark = pytest.mark.pipeline
MODEL = "SmolLM2-135M-Instruct"
MODULES = ("gateway", "tokenizer_svc", "scheduler_svc", "worker_svc", "detokenizer_svc")
Q_PROJ = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"


def peft_dir(root, name: str, rank: int) -> str:
    """A directory the fake reads as a PEFT adapter of rank `rank`."""
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"]}))
    (path / "adapter_model.safetensors").write_bytes(encode({}))
    return str(path)


def models(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}


def first_token(url: str, model: str) -> int:
    """The first token an adapter (a model) answers to the prompt [100]: 101 + its rank."""
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": [100], "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text
    return httpx.post(url + "/generate", json={"input_ids": [100], "sampling_params": {"max_new_tokens": 1}, "lora_path": model},
                      timeout=30).json()["output_ids"][0]


def push(url: str) -> None:
    tensors = {Q_PROJ.format("A"): np.ones((5, 8), np.float32), Q_PROJ.format("B"): np.zeros((8, 5), np.float32)}
    assert rl.push_adapter(url, "pushed", tensors, rank=5, alpha=8, target_modules=["q_proj"])["success"]


def restart(procs: dict, module: str, overrides: list[str], url: str, names: set[str]) -> None:
    """`module` stopped and started again; returns once the stack is healthy and lists `names`: the
    scheduler looks its peers up once a heartbeat (redis.heartbeat_ms), and a fake worker may be
    back within one."""
    procs[module].stop()
    procs[module] = start_service(module, overrides)
    wait_for(lambda: healthy(url) and models(url) == names, 60, f"a new {module}, and the adapters {sorted(names)}", interval=0.25)


def test_adapters_come_back_after_a_worker_a_scheduler_and_a_redis_restart(tmp_path):
    redis = EmbeddedRedis().start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    overrides = stack_overrides(redis.url, port, "worker=fake", "worker.lora.max_adapters=3", "worker.lora.max_rank=8",
                                f"+worker.lora.adapters.start={peft_dir(tmp_path, 'start', 1)}", "redis.heartbeat_ttl_ms=3000")
    procs = {m: start_service(m, overrides) for m in MODULES}
    try:
        wait_for(lambda: healthy(url), 120, "the services to be healthy", interval=0.25)
        loaded = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "three", "lora_path": peft_dir(tmp_path, "three", 3)},
                            timeout=30)
        assert loaded.status_code == 200, loaded.text
        push(url)
        assert models(url) == {MODEL, "start", "three", "pushed"}

        restart(procs, "worker_svc", overrides, url, {MODEL, "start", "three"})  # its slots went with it
        assert (first_token(url, "three"), first_token(url, "start"), first_token(url, MODEL)) == (104, 102, 101)
        r = httpx.post(url + "/v1/completions", json={"model": "pushed", "prompt": [100], "max_tokens": 1}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["message"] == "The model `pushed` does not exist."
        push(url)  # as the trainer does
        assert first_token(url, "pushed") == 106

        restart(procs, "scheduler_svc", overrides, url, {MODEL, "start", "three"})  # its registry went; the worker's slots stay
        assert (first_token(url, "three"), first_token(url, "start")) == (104, 102)
        push(url)

        redis.stop()  # back with no persistence: the names every gateway reads are gone
        redis = EmbeddedRedis(port=redis.port).start()
        wait_for(lambda: healthy(url) and models(url) == {MODEL, "start", "three", "pushed"}, 30,
                 "the names written again after the Redis restart", interval=0.25)
        assert (first_token(url, "three"), first_token(url, "pushed")) == (104, 106)
        assert_idle(url)
        for proc in procs.values():
            assert "Traceback" not in proc.log(), proc.log()[-3000:]
    finally:
        for proc in procs.values():
            proc.stop()
        redis.stop()
