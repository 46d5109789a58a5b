"""LoRA adapters (worker_svc/adapters.py, layers/lora.py) against `peft`: a tiny Llama and a tiny Qwen3
(transformers from_config, redrawn weights), three PEFT adapters each made by the `peft` package (random
A and B; ranks 4, 8 and 8, the last rsLoRA; targets q, k, v, o, gate, up, down), saved as PEFT
directories and read by our reader. One Driver run mixes the three adapters and the base model in the
same steps (chunked prefill beside decode): each request's logits match its adapter's model merged by
peft (merge_and_unload) in float32, greedy tokens equal. Then adapters are swapped and cleared between
runs, and nothing recompiles. The same batch under tp2 (four fake devices: lora_tp.py, in the
suite's idle time).

    python -m pytest tests/model/test_lora.py -rP    # also prints each model's largest difference
"""

import copy
import json
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest

from jaxstream import protocol
from jaxstream.config.worker import LoraConfig
from scheduler_svc.adapters import AdapterRegistry
from tests.model.parity import BUCKETS, BUDGET, NUM_PAGES, PAGE_SIZE, redraw
from tests.worker.driver import Driver
from worker_svc.adapters import AdapterSlots
from worker_svc.engine import Engine
from worker_svc.loading import load_model
from worker_svc.weights import open_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOLERANCE = 1e-4  # max |logit difference|, float32
NEW_TOKENS = 12
NUMBERS = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"r4": dict(r=4, lora_alpha=8), "r8": dict(r=8, lora_alpha=16), "rs8": dict(r=8, lora_alpha=4, use_rslora=True)}
PROMPTS = {"r4": 19, "r8": 40, "rs8": 6, "base": 11}  # request -> prompt length; the request's adapter is its name
GREEDY = protocol.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def make_adapter(base, out, seed: int, **numbers):
    """A PEFT adapter of `base` with random A and B, saved to `out`; returns peft's merged model."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(target_modules=TARGETS, init_lora_weights=False, lora_dropout=0.0, **numbers)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # B ~ the base's own scale, so each adapter moves the logits well past the tolerance
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.save_pretrained(out, safe_serialization=True)
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module", params=["Llama", "Qwen3"])
def served(request, tmp_path_factory):
    """(name, {request: the model it should match}, {adapter: its directory}, our Engine with them loaded)."""
    out = tmp_path_factory.mktemp(request.param)
    models, dirs = saved(request.param, out)
    return request.param, models, dirs, engine_with_adapters(out, dirs)


def saved(family: str, out) -> tuple[dict, dict]:
    """The seeded tiny `family` model in out/base and its ADAPTERS in out/<name>: ({request: the model
    it should match}, {adapter: its directory})."""
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**NUMBERS)
    base = redraw(getattr(transformers, f"{family}ForCausalLM")(config))
    base.save_pretrained(out / "base")
    models, dirs = {"base": base}, {}
    for seed, (name, numbers) in enumerate(ADAPTERS.items(), 1):
        dirs[name] = out / name
        models[name] = make_adapter(base, dirs[name], seed, **numbers)
    return models, dirs


def engine_with_adapters(out, dirs: dict, layout=None) -> Engine:
    """Our Engine of out/base, under `layout` (None: one device), ADAPTERS in slots 0, 1, 2."""
    engine = Engine(load_model(open_checkpoint(out / "base"), progress=False, layout=layout), BUCKETS, PAGE_SIZE, NUM_PAGES,
                    layout=layout, lora=LoraConfig(max_adapters=4, max_rank=8))
    for slot, name in enumerate(ADAPTERS):
        engine.load_adapter(slot, str(dirs[name]))
    return engine


def expected(model, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    with torch.no_grad():
        tokens = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].numpy()
    return tokens, logits


def run_mixed(engine, adapter_of: dict[str, str | None]) -> dict:
    """One Driver run of PROMPTS' requests together, each naming its adapter (None: base), which the
    scheduler's registry places in the slots engine_with_adapters loaded them into."""
    registry = AdapterRegistry(engine.adapters.slots, {name: (slot, "") for slot, name in enumerate(ADAPTERS)})
    rng = np.random.default_rng(0)
    prompts = {rid: rng.integers(0, NUMBERS["vocab_size"], n).tolist() for rid, n in PROMPTS.items()}
    driver = Driver(engine, PAGE_SIZE, NUM_PAGES, budget=BUDGET, max_running=4, keep_logits=True, adapters=registry)
    traces = driver.run([(rid, prompt, msgspec.structs.replace(GREEDY, lora=adapter_of[rid] if adapter_of[rid] in ADAPTERS else "")) for rid, prompt in prompts.items()])
    assert any(len({seq.rid for seq in s.seqs}) == 4 for s in driver.steps)  # all four share steps
    return prompts, traces


def test_three_adapters_and_the_base_model_in_one_batch_match_peft_merged(served):
    name, models, _, engine = served
    prompts, traces = run_mixed(engine, {rid: rid for rid in PROMPTS})
    worst = {}
    for rid, prompt in prompts.items():
        tokens, logits = expected(models[rid], prompt)
        assert traces[rid].tokens == tokens, (name, rid)
        worst[rid] = float(np.abs(np.stack(traces[rid].logits) - logits).max())
    moved = float(np.abs(expected(models["r4"], prompts["r4"])[1] - expected(models["base"], prompts["r4"])[1]).max())
    print(f"{name}: max |logit diff| vs peft merged: {worst}; an adapter moves the logits by {moved:.2f}")  # -rP
    assert max(worst.values()) <= TOLERANCE, worst
    assert moved > 100 * TOLERANCE  # the adapters are not negligible


def test_swapping_and_clearing_slots_recompiles_nothing(served):
    name, models, dirs, engine = served
    compiled = engine.compiled
    try:
        engine.load_adapter(0, str(dirs["r8"]))  # slot 0 now holds r8: request r4 answers as r8
        engine.clear_adapter(1)  # slot 1 empty: request r8 answers as the base model
        prompts, traces = run_mixed(engine, {"r4": "r4", "r8": "r8", "rs8": "rs8", "base": None})
        assert traces["r4"].tokens == expected(models["r8"], prompts["r4"])[0]
        assert traces["r8"].tokens == expected(models["base"], prompts["r8"])[0]
        assert traces["rs8"].tokens == expected(models["rs8"], prompts["rs8"])[0]
        assert engine.compiled == compiled
    finally:
        for slot, adapter in enumerate(ADAPTERS):
            engine.load_adapter(slot, str(dirs[adapter]))


def test_an_adapter_that_does_not_fit_is_refused_by_name(served, tmp_path):
    _, _, dirs, engine = served
    found, dtype = engine.adapters.found, engine.adapters.scale.dtype
    with pytest.raises(ValueError, match="rank 8 is above worker.lora.max_rank 4"):
        AdapterSlots(found, 2, 1, 4, engine.adapters.targets, dtype).load(0, str(dirs["r8"]))
    with pytest.raises(ValueError, match="target module 'down_proj' is not in worker.lora.target_modules"):
        AdapterSlots(found, 2, 1, 8, ("q", "v"), dtype).load(0, str(dirs["r4"]))
    with pytest.raises(ValueError, match="adapter slot 4 is not in"):
        engine.load_adapter(4, str(dirs["r4"]))
    (tmp_path / "adapter_config.json").write_text((dirs["r4"] / "adapter_config.json").read_text())
    with pytest.raises(ValueError, match="no adapter_model.safetensors"):
        engine.load_adapter(0, str(tmp_path))
    (tmp_path / "adapter_config.json").unlink()
    (tmp_path / "adapter_model.safetensors").write_bytes((dirs["r4"] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="no adapter_config.json"):
        engine.load_adapter(0, str(tmp_path))


def test_the_same_batch_under_tp2_matches_peft_merged(lora_sharded_runs):
    """tests/model/lora_tp.py's run: the Llama's shards under tp2, the adapter slots replicated."""
    results = Path(lora_sharded_runs.stdout("lora_tp").split()[-1])
    try:
        runs = np.load(results)
        for rid in PROMPTS:
            assert runs[f"{rid}/tokens"].tolist() == runs[f"{rid}/peft_tokens"].tolist(), rid
            assert np.abs(runs[f"{rid}/logits"] - runs[f"{rid}/peft_logits"]).max() <= TOLERANCE, rid
    finally:
        shutil.rmtree(results.parent)


@pytest.mark.parametrize("family, config, adapted", [
    ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2), ["k", "o", "q", "v"]),  # experts never
    ("Gemma2", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8), ["down", "gate", "k", "o", "q", "up", "v"]),
    ("DeepseekV3", dict(n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1, moe_intermediate_size=32,
                        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1,
                        topk_group=1), ["down", "gate", "up"]),  # the dense layer's MLP; latent attention and shared experts never
])
def test_only_the_projections_that_add_deltas_take_adapters(family, config, adapted, tmp_path):
    """A module that would not add a target's delta (an expert, DeepSeek's latent attention or shared
    experts) offers none: an adapter for it is refused, never loaded and silently ignored."""
    from flax import nnx

    from jaxstream import safetensors
    from worker_svc.adapters import projections, read_peft
    from worker_svc.loading import model_config
    from worker_svc.weights import Checkpoint
    from worker_svc.weights.hf_dir import with_implicit_keys

    numbers = {**NUMBERS, **config, "architectures": [f"{family}ForCausalLM"]}
    model_cls, cfg, _ = model_config(Checkpoint(Path(family), with_implicit_keys(numbers), (), None))
    found = projections(nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(0))))
    assert sorted(found) == adapted
    layers = {name: sorted(layers) for name, (_, _, layers) in found.items()}
    assert all(ids == ([0] if family.startswith("Deepseek") else [0, 1]) for ids in layers.values()), layers
    if family == "Mixtral":  # its MLP is experts: an adapter of gate, up or down is refused by name
        (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": ["q_proj", "up_proj"]}))
        (tmp_path / "adapter_model.safetensors").write_bytes(safetensors.encode({}))
        with pytest.raises(ValueError, match="target module 'up_proj' is not adaptable in this model"):
            read_peft(tmp_path, found, 8, ("q", "k", "v", "o", "gate", "up", "down"))
