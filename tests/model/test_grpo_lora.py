"""examples/grpo/lora.py, the trainer's LoRA, against our server's: the trainer's base weights saved as a
checkpoint and its adapter as a PEFT directory (adapter_config.json + adapter_model.safetensors, by
the names a push sends), read by worker_svc/adapters.py into an Engine's adapter slot and run through
the Driver beside a base-model request: each request's logits are the trainer's forward's (with the
adapter, and without) to LOGIT_TOLERANCE. Also PEFT's init (B zero: the adapter starts as the base
model), the names the push sends, and that the trainer adapts the projections the server does."""

import json

import jax
import jax.numpy as jnp
import numpy as np

from examples.grpo import lora
from examples.grpo.model import Lora, forward, init_params, to_hf
from jaxstream import protocol, safetensors
from jaxstream.config.worker import LoraConfig
from tests.model.parity import BUCKETS, BUDGET, NUM_PAGES, PAGE_SIZE
from scheduler_svc.adapters import AdapterRegistry
from tests.model.test_grpo_model import CONFIG, config
from tests.worker.driver import Driver
from worker_svc.layers.numerics import Numerics
from worker_svc.engine import Engine
from worker_svc.loading import load_model
from worker_svc.weights import open_checkpoint

# float32. Not 0: this in-process engine's logits (batch_invariant, from a checkpoint directory) are not
# the trainer's to the bit even for the base request; the served stack's logprobs are (test_rl_example).
LOGIT_TOLERANCE = 1e-5
RANK, ALPHA = 4, 8.0
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # gate, up, down: on the dense layer only
OVERRIDES = dict(norm_topk_prob=True, mlp_only_layers=[1])
NEW_TOKENS = 8


def trained_adapter(cfg, seed: int) -> list:
    """PEFT's init with B drawn too (as if trained), so the adapter moves the logits."""
    weights = lora.init(cfg, RANK, TARGETS, seed)
    keys = iter(jax.random.split(jax.random.key(seed + 1), 64))
    return [{t: (a, jax.random.normal(next(keys), b.shape, jnp.float32) * RANK**-0.5) for t, (a, b) in layer.items()}
            for layer in weights]


def save(tmp_path, cfg, params, weights) -> tuple:
    """The base as a checkpoint directory and the adapter as a PEFT directory."""
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    base.mkdir(), adapter.mkdir()
    hf_config = {**CONFIG, **OVERRIDES, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "float32"}
    (base / "config.json").write_text(json.dumps(hf_config))
    (base / "model.safetensors").write_bytes(safetensors.encode(to_hf(params, cfg)))
    (adapter / "adapter_config.json").write_text(json.dumps(lora.peft_config(RANK, ALPHA, TARGETS)))
    (adapter / "adapter_model.safetensors").write_bytes(safetensors.encode(lora.to_peft(weights, cfg)))
    return base, adapter


def test_the_served_adapter_is_the_trainers_forward(tmp_path):
    cfg = config(**OVERRIDES)
    params, weights = init_params(cfg, 0, embed_std=0.2), trained_adapter(cfg, 1)  # the example's embedding std
    base, adapter = save(tmp_path, cfg, params, weights)
    engine = Engine(load_model(open_checkpoint(base), progress=False, numerics=Numerics(batch_invariant=True)), BUCKETS, PAGE_SIZE, NUM_PAGES,
                    lora=LoraConfig(max_adapters=2, max_rank=8))
    engine.load_adapter(1, str(adapter))
    registry = AdapterRegistry(engine.adapters.slots, {"trained": (1, str(adapter))})
    rng = np.random.default_rng(0)
    prompts = {rid: rng.integers(0, CONFIG["vocab_size"], 13).tolist() for rid in ("adapted", "base")}  # one length: fewer compiles
    greedy = {rid: protocol.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, lora=name)
              for rid, name in (("adapted", "trained"), ("base", ""))}
    driver = Driver(engine, PAGE_SIZE, NUM_PAGES, budget=BUDGET, max_running=2, keep_logits=True, adapters=registry)
    traces = driver.run([(rid, prompt, greedy[rid]) for rid, prompt in prompts.items()])
    assert any(len(s.seqs) == 2 for s in driver.steps)  # the adapter's rows and the base's share steps
    adapter_of = {"adapted": Lora(weights, lora.scale(RANK, ALPHA)), "base": None}
    diffs = {}
    for rid, prompt in prompts.items():
        tokens = jnp.asarray(prompt + traces[rid].tokens)
        ours, _ = forward(params, cfg, tokens, page_size=PAGE_SIZE, lora=adapter_of[rid])
        diffs[rid] = float(np.abs(np.asarray(ours[len(prompt) - 1 : -1]) - np.stack(traces[rid].logits)).max())
    plain, _ = forward(params, cfg, jnp.asarray(prompts["adapted"] + traces["adapted"].tokens), page_size=PAGE_SIZE)
    moved = float(np.abs(np.asarray(plain[len(prompts["adapted"]) - 1 : -1]) - np.stack(traces["adapted"].logits)).max())
    print(f"max |logit diff| trainer vs served: {diffs}; the adapter moves the logits by {moved:.3f}")  # -rP
    assert max(diffs.values()) <= LOGIT_TOLERANCE, diffs
    assert moved > 100 * LOGIT_TOLERANCE  # the adapter is really applied, not a no-op


def test_peft_init_is_the_base_model_and_the_push_names_peft_tensors():
    cfg = config(**OVERRIDES)  # 3 layers, the middle one dense
    weights = lora.init(cfg, RANK, TARGETS, 0)
    assert [sorted(layer) for layer in weights] == [["k", "o", "q", "v"], sorted(TARGETS), ["k", "o", "q", "v"]]
    a, b = weights[0]["q"]
    assert a.shape == (64, RANK) and np.abs(np.asarray(a)).max() <= 64**-0.5 and (np.asarray(b) == 0).all()
    params, tokens = init_params(cfg, 0), jnp.asarray(np.arange(11))
    base, _ = forward(params, cfg, tokens)
    with_init, _ = forward(params, cfg, tokens, lora=Lora(weights, lora.scale(RANK, ALPHA)))
    assert (np.asarray(base) == np.asarray(with_init)).all()
    tensors = lora.to_peft(weights, cfg)
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (RANK, 64)  # [r, in]
    assert tensors["base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"].shape == (64, RANK)  # [out, r]
    assert tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].shape == (RANK, CONFIG["intermediate_size"])
    assert not any("layers.0.mlp" in name or "layers.2.mlp" in name for name in tensors)  # experts never
    assert len(tensors) == 2 * (4 * 3 + 3)


def test_the_trainer_adapts_exactly_the_projections_the_server_does():
    """Per layer, the trainer's adaptable projections (lora.keys over every target) are the served
    model's (adapters.projections): attention everywhere, the MLP's on the dense layer alone."""
    from pathlib import Path

    from flax import nnx

    from worker_svc.adapters import projections
    from worker_svc.loading import model_config
    from worker_svc.weights import Checkpoint
    from worker_svc.weights.hf_dir import with_implicit_keys

    numbers = {**CONFIG, **OVERRIDES, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
    model_cls, served_cfg, _ = model_config(Checkpoint(Path("qwen3_moe"), with_implicit_keys(numbers), (), None))
    found = projections(nnx.eval_shape(lambda: model_cls(served_cfg, rngs=nnx.Rngs(0))))
    served = {(target, layer) for target, (_, _, layers) in found.items() for layer in layers}
    cfg = config(**OVERRIDES)
    ours = {(target, i) for i in range(cfg.layers) for target in lora.keys(cfg, i, TARGETS)}
    assert ours == served
    shapes = {(t, i): lora.shapes(cfg, i, TARGETS)[t] for t, i in ours}
    assert shapes == {(t, i): found[t][:2] for t, i in served}  # (Din, Dout) as the slots hold them
