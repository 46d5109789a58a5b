"""LoRA adapters (worker_svc/adapters.py, layers/lora.py) against `peft`: a tiny Llama and a tiny Qwen3
(transformers from_config, redrawn weights), three PEFT adapters each made by the `peft` package (random
A and B; ranks 4, 8 and 8, the last rsLoRA; targets q, k, v, o, gate, up, down), saved as PEFT
directories and read by our reader. One Driver run mixes the three adapters and the base model in the
same steps (chunked prefill beside decode): each request's logits match its adapter's model merged by
peft (merge_and_unload) in float32, greedy tokens equal. Then adapters are swapped and cleared between
runs, and nothing recompiles. The same batch under tp2, and a Qwen3-MoE's under ep2 (four fake
devices: lora_tp.py, in the suite's idle time). Under batch_invariant, over int8 base weights, with
n-gram drafts; an adapter made for another model refused naming the size.

    python -m pytest tests/model/test_lora.py -rP    # also prints each model's largest difference
"""

import copy
import dataclasses
import json
import shutil
from collections import Counter
from pathlib import Path

import msgspec
import numpy as np
import pytest

from jaxstream import protocol, safetensors
from jaxstream.config.worker import LoraConfig
from scheduler_svc.adapters import AdapterRegistry
from tests.model.parity import BUCKETS, BUDGET, NUM_PAGES, PAGE_SIZE, redraw
from tests.worker.driver import Driver
from worker_svc.batch import Buckets
from worker_svc.adapters import AdapterSlots
from worker_svc.engine import Engine
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.quantized import quantize
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


def make_adapter(base, out, seed: int, targets=TARGETS, **numbers):
    """A PEFT adapter of `base` with random A and B on `targets`, saved to `out`; returns peft's merged model."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(target_modules=targets, init_lora_weights=False, lora_dropout=0.0, **numbers)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # B ~ the base's own scale, so each adapter moves the logits well past the tolerance
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.save_pretrained(out, safe_serialization=True)
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (its directory, {request: the model it should match}, {adapter: its directory}): `saved`
    once per family and module."""
    made = {}

    def get(family: str):
        if family not in made:
            out = tmp_path_factory.mktemp(family)
            made[family] = (out, *saved(family, out))
        return made[family]

    return get


@pytest.fixture(scope="module", params=["Llama", "Qwen3"])
def served(request, checkpoints):
    """(name, {request: the model it should match}, {adapter: its directory}, our Engine with them loaded)."""
    out, models, dirs = checkpoints(request.param)
    return request.param, models, dirs, engine_with_adapters(out, dirs)


def saved(family: str, out, targets=TARGETS, **config) -> tuple[dict, dict]:
    """The seeded tiny `family` model (NUMBERS and `config`) in out/base and its ADAPTERS on `targets` in
    out/<name>: ({request: the model it should match}, {adapter: its directory})."""
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**NUMBERS, **config)
    base = redraw(getattr(transformers, f"{family}ForCausalLM")(config))
    base.save_pretrained(out / "base")
    models, dirs = {"base": base}, {}
    for seed, (name, numbers) in enumerate(ADAPTERS.items(), 1):
        dirs[name] = out / name
        models[name] = make_adapter(base, dirs[name], seed, targets, **numbers)
    return models, dirs


def engine_with_adapters(out, dirs: dict, layout=None, numerics: Numerics = Numerics(), moe: str = "fused",
                         buckets: Buckets = BUCKETS) -> Engine:
    """Our Engine of out/base, under `layout` (None: one device) with `numerics`, ADAPTERS in slots 0, 1, 2."""
    model = load_model(open_checkpoint(out / "base"), progress=False, layout=layout, numerics=numerics, moe=moe)
    engine = Engine(model, buckets, PAGE_SIZE, NUM_PAGES, layout=layout, lora=LoraConfig(max_adapters=4, max_rank=8))
    for slot, name in enumerate(ADAPTERS):
        engine.load_adapter(slot, str(dirs[name]))
    return engine


def expected(model, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    with torch.no_grad():
        tokens = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].numpy()
    return tokens, logits


def run_mixed(engine, adapter_of: dict[str, str | None]) -> dict:
    """One Driver run of PROMPTS' requests together, each naming its adapter (None: base)."""
    rng = np.random.default_rng(0)
    prompts = {rid: rng.integers(0, NUMBERS["vocab_size"], n).tolist() for rid, n in PROMPTS.items()}
    driver, traces = run(engine, {rid: (prompt, adapter_of[rid]) for rid, prompt in prompts.items()})
    assert any(len({seq.rid for seq in s.seqs}) == 4 for s in driver.steps)  # all four share steps
    return prompts, traces


def run(engine, requests: dict[str, tuple[list[int], str | None]], drafter=None) -> tuple[Driver, dict]:
    """One Driver run of `requests` (rid -> (prompt, the adapter it names or None)), greedy, with
    `drafter`'s drafts; the scheduler's registry places each adapter in the slot engine_with_adapters
    loaded it into."""
    registry = AdapterRegistry(engine.adapters.slots, {name: (slot, "") for slot, name in enumerate(ADAPTERS)})
    driver = Driver(engine, PAGE_SIZE, NUM_PAGES, budget=BUDGET, max_running=4, keep_logits=True, adapters=registry, drafter=drafter)
    return driver, driver.run([(rid, prompt, msgspec.structs.replace(GREEDY, lora=adapter if adapter in ADAPTERS else ""))
                               for rid, (prompt, adapter) in requests.items()])


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


def test_swapping_slots_recompiles_nothing(served):
    name, models, dirs, engine = served
    compiled = engine.compiled
    try:
        engine.load_adapter(0, str(dirs["r8"]))  # slot 0 now holds r8: request r4 answers as r8
        engine.load_adapter(1, str(dirs["r4"]))  # and slot 1 r4 (of a lower rank: the rest of its rows zeroed)
        prompts, traces = run_mixed(engine, {"r4": "r4", "r8": "r8", "rs8": "rs8", "base": None})
        assert traces["r4"].tokens == expected(models["r8"], prompts["r4"])[0]
        assert traces["r8"].tokens == expected(models["r4"], prompts["r8"])[0]
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


def test_an_adapter_made_for_another_model_is_refused_naming_the_size(served, tmp_path):
    _, _, dirs, engine = served
    stored = dict(safetensors.decode((dirs["r4"] / "adapter_model.safetensors").read_bytes()))
    (tmp_path / "adapter_config.json").write_text((dirs["r4"] / "adapter_config.json").read_text())

    def refused(tensors: dict, message: str) -> None:
        (tmp_path / "adapter_model.safetensors").write_bytes(safetensors.encode(tensors))
        with pytest.raises(ValueError, match=message):
            engine.load_adapter(3, str(tmp_path))

    wider = {name: np.zeros((4, 2048), np.float32) if "lora_A" in name and "mlp.down_proj" not in name and "o_proj" not in name
             else t for name, t in stored.items()}  # every A reading the hidden state, of a model 2048 wide
    refused(wider, "was made for a model with hidden_size 2048, this model has 64")
    deeper = stored | {name.replace(".layers.1.", ".layers.2."): t for name, t in stored.items() if ".layers.1." in name}
    refused(deeper, "was made for a model with 3 layers \\(num_hidden_layers\\), this model has 2")
    shallower = {name: t for name, t in stored.items() if ".layers.1." not in name}
    refused(shallower, "was made for a model with 1 layers \\(num_hidden_layers\\), this model has 2")
    narrower = {name: t[:, :96] if "down_proj.lora_A" in name else t for name, t in stored.items()}
    refused(narrower, "was made for a model with intermediate_size 96, this model has 128")
    assert 3 not in engine.adapters.loaded


def test_an_adapters_rows_are_bit_identical_alone_and_in_any_batch_under_batch_invariant(checkpoints):
    """worker.batch_invariant: a request under an adapter, alone (decoding in the 4-token bucket) and
    among the other adapters' and the base model's requests (its prompt chunked beside their decode,
    its decode in the 64-token bucket, whose matmuls XLA:CPU sums in another order than 4 rows':
    layers/numerics.py): the same logits, bit for bit."""
    out, models, dirs = checkpoints("Llama")
    buckets = dataclasses.replace(BUCKETS, tokens=(4, 64))
    engine = engine_with_adapters(out, dirs, numerics=Numerics(batch_invariant=True), buckets=buckets)
    rng = np.random.default_rng(5)
    target = rng.integers(0, NUMBERS["vocab_size"], 29).tolist()
    others = {f"o{i}": (rng.integers(0, NUMBERS["vocab_size"], int(n)).tolist(), adapter)
              for i, (n, adapter) in enumerate(zip((40, 7, 23, 3, 51), ("r4", None, "rs8", "r8", None)))}
    _, alone = run(engine, {"t": (target, "r8")})
    driver, crowd = run(engine, {"t": (target, "r8")} | others)
    assert sum(len(s.seqs) > 1 for s in driver.steps if "t" in {seq.rid for seq in s.seqs}) >= 10  # in company
    assert alone["t"].tokens == crowd["t"].tokens == expected(models["r8"], target)[0]
    assert np.array_equal(np.stack(alone["t"].logits), np.stack(crowd["t"].logits))


def test_adapters_apply_over_int8_base_weights(checkpoints):
    """worker.quantization=int8: the adapters' deltas add to the int8 base's projections as to float
    ones. Each request's logits match, in float32, its adapter merged by peft into the base model whose
    every matrix is its int8 round trip (quantized.py's scale per output channel): the quantization's
    error is the base's alone, and greedy tokens are equal."""
    out, models, dirs = checkpoints("Llama")
    prompts, traces = run_mixed(engine_with_adapters(out, dirs, numerics=Numerics(quantization="int8")), {rid: rid for rid in PROMPTS})
    base = int8_round_trip(models["base"])
    worst = {}
    for rid, prompt in prompts.items():
        model = base if rid == "base" else peft.PeftModel.from_pretrained(copy.deepcopy(base), dirs[rid]).merge_and_unload().eval()
        tokens, logits = expected(model, prompt)
        assert traces[rid].tokens == tokens, rid
        worst[rid] = float(np.abs(np.stack(traces[rid].logits) - logits).max())
    assert max(worst.values()) <= TOLERANCE, worst
    float_merged = expected(models["r4"], prompts["r4"])[1]
    assert np.abs(np.stack(traces["r4"].logits) - float_merged).max() > 100 * TOLERANCE  # int8 served: not vacuous


def int8_round_trip(model):
    """A copy of the transformers `model` whose every matrix ([out, in]: a scale per output row, as
    quantized.py's per output channel; the embedding's per vocabulary row) is dequantized from int8."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                values, scale = quantize(p.numpy(), (1,))
                p.copy_(torch.from_numpy(values.astype(np.float32) * scale))
    return model


def test_ngram_drafts_are_verified_under_the_requests_adapter(served):
    """scheduler.speculative=ngram: a request's drafts are verified under its adapter (another's, or the
    base model's, would turn tokens away): the tokens and logits of decoding one token a step."""
    from scheduler_svc.ngram import NgramDrafter

    _, models, _, engine = served
    block = np.random.default_rng(7).integers(0, NUMBERS["vocab_size"], 8).tolist()
    requests = {"a": (block * 3, "r8"), "b": (block * 2 + block[:3], "rs8"), "c": (block * 3, None)}
    _, plain = run(engine, requests)
    driver, drafted = run(engine, requests, NgramDrafter(4, 1, 3))
    for rid, (prompt, adapter) in requests.items():
        assert drafted[rid].tokens == plain[rid].tokens == expected(models[adapter or "base"], prompt)[0], rid
        np.testing.assert_allclose(np.stack(drafted[rid].logits), np.stack(plain[rid].logits), atol=1e-5, err_msg=rid)
    stats = driver.scheduler.core.stats()
    assert stats["spec_decode_num_accepted_tokens_total"] > 0, stats  # drafts were verified, and some taken


def test_the_same_batch_under_tp2_and_ep2_matches_peft_merged_adding_one_small_all_reduce_per_row_parallel_projection(
        lora_sharded_runs):
    """tests/model/lora_tp.py's runs: the Llama's shards under tp2, each adapter's A and B split as its
    base weight, and a Qwen3-MoE's attention adapters under ep2. The slots add to the Llama's forward
    step only the all-reduce of o's and down's partial x @ A ([T, r], where their base weights' own
    all-reduce is [T, D]): q, k, v, gate and up, whose B is split as their output, add none."""
    results = Path(lora_sharded_runs.stdout("lora_tp").split()[-1])
    try:
        runs = np.load(results)
        for family in ("Llama", "Qwen3Moe"):
            for rid in PROMPTS:
                key = f"{family}/{rid}"
                assert runs[f"{key}/tokens"].tolist() == runs[f"{key}/peft_tokens"].tolist(), key
                assert np.abs(runs[f"{key}/logits"] - runs[f"{key}/peft_logits"]).max() <= TOLERANCE, key
        added = Counter(runs["collectives/with_slots"].tolist()) - Counter(runs["collectives/without"].tolist())
        assert added == {f"all-reduce f32[{int(runs['collectives/tokens'])},8]{{1,0}}": 2}, added  # o and down, max_rank 8
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
