"""GPT-OSS, a small random config: our worker against transformers' GptOssForCausalLM (PyTorch, CPU,
float32) on the same weights (every one redrawn, sinks and biases too), saved by transformers and read
back by our loader. Its first layer slides by a window smaller than the prompts, its second attends in
full; YaRN rotary; the SwiGLU's clamp low enough to bite. As in test_families.py: prompts run together
through the real scheduler core (chunked prefill beside batched paged decode), then a request whose
first pages are a prefix-cache hit, with the numerics served on this machine (the CPU kernels, the
attention kernel's at the released head dimension 64); under both MoE strategies, and under tp2, ep2 and tp2_ep2 on
fake devices (gpt_oss_tp.py, in the suite's idle time); the routed experts as
transformers' router picks them; int8 weights; and MXFP4 checkpoints, dequantized as transformers does.

    python -m pytest tests/model/test_gpt_oss.py -rP    # also prints the largest differences
"""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxstream.config import load_config
from tests.model.gpt_oss_tp import GREEDY, parity_requests
from tests.model.parity import (BUCKETS, NEW_TOKENS, NUM_PAGES, PAGE_SIZE, PROMPT_LENGTHS, assert_refused,
                                   random_prompts, redraw, assert_int8_follows, assert_routed_experts_are_transformers,
                                   assert_weights_read_back, run_with_a_prefix_hit)
from worker_svc import start
from worker_svc.engine import Engine
from worker_svc.hf_index import hf_tensors
from worker_svc.layers.numerics import Numerics
from worker_svc.layers.quantized import quantize
from worker_svc.loading import check_hf_config, load_model, model_config, open_model
from worker_svc.weights import Checkpoint, open_checkpoint
from worker_svc.weights.hf_dir import with_implicit_keys
from worker_svc.weights.mxfp4 import FP4_VALUES

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4  # max |logit difference|, float32
WINDOW = 12  # the sliding layer's: less than the long prompts, and not whole pages
NUMBERS = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
               sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], swiglu_limit=3.0,
               max_position_embeddings=512, tie_word_embeddings=False,
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 128})
EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def hf_model():
    torch.manual_seed(0)
    return redraw(transformers.GptOssForCausalLM(transformers.GptOssConfig(**NUMBERS)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(transformers model, the directory it saved)."""
    hf = hf_model()
    out = tmp_path_factory.mktemp("gpt_oss")
    hf.save_pretrained(out)
    return hf, out


@pytest.fixture(scope="module")
def models(saved):
    """(transformers model, its saved directory, {MoE strategy: our Engine loaded from it, with the
    numerics served on this machine: the CPU kernels where they build, the attention kernel's for the
    head dimension 64 of the released models})."""
    hf, out = saved
    checkpoint, served = open_checkpoint(out), start.numerics(load_config([]))
    engines = {strategy: Engine(load_model(checkpoint, progress=False, moe=strategy, numerics=served), BUCKETS, PAGE_SIZE,
                                NUM_PAGES, routed_experts=True) for strategy in ("fused", "ep")}
    return hf, out, engines


@pytest.fixture(scope="module")
def expected(models):
    """transformers' greedy tokens and the logits before each, per request."""
    hf = models[0]
    answers = {}
    for rid, prompt in parity_requests(NUMBERS["vocab_size"]):
        with torch.no_grad():
            tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()
            answers[rid] = tokens, hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].numpy()
    return answers


def worst_difference(runs: dict, expected: dict, what: str) -> float:
    """The largest |logit difference| over every request of `runs` ({rid: (tokens, logits)}), their
    greedy tokens equal transformers'."""
    for rid, (tokens, _) in expected.items():
        assert list(runs[rid][0]) == tokens, f"{what} {rid}"
    return max(float(np.abs(np.asarray(runs[rid][1]) - logits).max()) for rid, (_, logits) in expected.items())


def test_logits_match_transformers_through_chunked_prefill_decode_and_a_prefix_cache_hit(models, expected):
    _, _, engines = models
    requests = parity_requests(NUMBERS["vocab_size"])
    worst = {}
    for strategy, engine in engines.items():
        traces = run_with_a_prefix_hit(engine, requests, GREEDY)
        worst[strategy] = worst_difference({rid: (t.tokens, np.stack(t.logits)) for rid, t in traces.items()}, expected, strategy)
    print(f"gpt-oss: max |logit diff| over prompts of {PROMPT_LENGTHS} and a cache hit, {NEW_TOKENS} steps each, window "
          f"{WINDOW}: " + ", ".join(f"{s} {d:.2e}" for s, d in worst.items()) +
          f" (logit std {expected['p0'][1].std():.2f})")  # -rP
    assert max(worst.values()) <= TOLERANCE, worst


def test_tensor_and_expert_parallel_runs_match_transformers_too(gpt_oss_sharded_runs, expected):
    """tp2 (`fused`), ep2 and tp2_ep2 (`ep`) on fake devices, the same checkpoint (hf_model is seeded)
    loaded into its shards: gpt_oss_tp.py, run in the suite's idle time (tests/background.py)."""
    saved = gpt_oss_sharded_runs.arrays("gpt_oss_tp")
    worst = {}
    for layout in ("tp2", "ep2", "tp2_ep2"):
        runs = {rid: (saved[f"{layout}/{rid}/tokens"], saved[f"{layout}/{rid}/logits"]) for rid in expected}
        worst[layout] = worst_difference(runs, expected, layout)
    print("gpt-oss sharded: max |logit diff| " + ", ".join(f"{layout} {d:.2e}" for layout, d in worst.items()))  # -rP
    assert max(worst.values()) <= TOLERANCE, worst


def test_routed_experts_are_the_ones_transformers_router_picks(models):
    hf, _, engines = models
    assert_routed_experts_are_transformers(hf, engines, "router", NUMBERS["vocab_size"], NUMBERS["num_experts_per_tok"])


def test_the_weights_read_back_by_hugging_face_name_are_the_checkpoints(models):
    """The interleaved gate_up_proj's inverse included."""
    _, out, engines = models
    assert_weights_read_back(engines["fused"], out)


def test_int8_weights_give_transformers_logits_within_quantization_error(saved):
    hf, out = saved
    tokens = np.asarray(random_prompts(NUMBERS["vocab_size"])[1] * 3)  # 18 tokens: past the window
    for strategy in ("fused", "ep"):
        model = load_model(open_checkpoint(out), progress=False, moe=strategy, numerics=Numerics(quantization="int8"))
        assert_int8_follows(f"gpt-oss {strategy}", hf, model, tokens)


def mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The OCP MX rules, from the definition: each row of w [E, C, R] read as w's transpose [E, R, C]
    (as GPT-OSS stores its experts), in blocks of 32 values sharing the scale 2^(floor(log2(max |v|))
    - 2) (E2M1's largest exponent is 2), stored as E8M0 (the exponent + 127); each value divided by it
    and rounded to the nearest E2M1 value (clamped at +-6), its code's low nibble first. Returns
    (blocks uint8 [E, R, C/32, 16], scales uint8 [E, R, C/32])."""
    rows = w.transpose(0, 2, 1)
    blocks = rows.reshape(*rows.shape[:2], -1, 32)  # [E, R, G, 32]
    peak = np.abs(blocks).max(-1, keepdims=True)
    exponent = np.where(peak > 0, np.floor(np.log2(np.where(peak > 0, peak, 1))) - 2, 0).astype(np.int32)
    scaled = blocks / np.ldexp(np.float32(1), exponent)
    magnitudes = FP4_VALUES[:8]
    codes = np.abs(np.abs(scaled)[..., None] - magnitudes).argmin(-1) + 8 * (scaled < 0)  # [E, R, G, 32]
    packed = (codes[..., 0::2] | codes[..., 1::2] << 4).astype(np.uint8)
    # contiguous: numpy keeps the transpose's order, and safetensors.numpy writes a strided buffer as if it were not
    return np.ascontiguousarray(packed), np.ascontiguousarray(exponent[..., 0] + 127, np.uint8)


@pytest.fixture(scope="module")
def mxfp4_dir(saved, tmp_path_factory):
    """The checkpoint with its experts' matrices packed to MXFP4 (as the released ones are), and the packs."""
    _, out = saved
    tensors, packs = load_file(str(out / "model.safetensors")), {}
    for name in [n for n in tensors if n.endswith(EXPERT_TENSORS)]:
        packs[name] = mxfp4(tensors.pop(name))
        tensors[name + "_blocks"], tensors[name + "_scales"] = packs[name]
    directory = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    save_file(tensors, str(directory / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                                         "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))
    return directory, packs


def test_an_mxfp4_checkpoint_reads_as_transformers_dequantizes_it(mxfp4_dir):
    """Each packed tensor read by our reader and loaded into the model (float32, bfloat16, int8) equals
    transformers' own dequantization of the same blocks, exactly."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    directory, packs = mxfp4_dir
    checkpoint = open_checkpoint(directory)
    theirs = {name: convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32).numpy()
              for name, (blocks, scales) in packs.items()}
    assert not any(name.endswith(("_blocks", "_scales")) for name in checkpoint.names)
    for name, tensor in theirs.items():
        np.testing.assert_array_equal(checkpoint.read(name), tensor, err_msg=name)
    assert len(np.unique(theirs["model.layers.0.mlp.experts.down_proj"])) > 16  # blocks of different scales
    float32 = dict(hf_tensors(load_model(checkpoint, progress=False)))
    bf16 = dict(hf_tensors(load_model(checkpoint, "bfloat16", progress=False)))
    int8 = load_model(checkpoint, progress=False, numerics=Numerics(quantization="int8"))
    for name, tensor in theirs.items():
        np.testing.assert_array_equal(float32[name], tensor, err_msg=name)
        bf16_theirs = convert_moe_packed_tensors(*(torch.from_numpy(p) for p in packs[name]), dtype=torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(bf16[name].astype(np.float32), bf16_theirs, err_msg=name)
    layer = 0
    experts = int8.layers.mlp.experts
    gate_up = theirs[f"model.layers.{layer}.mlp.experts.gate_up_proj"]  # [E, D, 2F], interleaved
    values, scale = quantize(gate_up.reshape(*gate_up.shape[:2], -1, 2).swapaxes(-1, -2), (1,))
    np.testing.assert_array_equal(np.asarray(experts.gate_up.values[...])[layer], values)
    np.testing.assert_array_equal(np.asarray(experts.gate_up.scale[...])[layer], scale)


def test_the_released_20b_config_has_its_published_size_and_transformers_numbers():
    """configs/model/gpt_oss_20b.yaml built abstractly at full size: the model card's 20.9B parameters;
    its numbers are those transformers' GptOssConfig reads (default layer types and all), and a
    directory transformers writes for them satisfies the config key by key."""
    model = load_config(["model=gpt_oss_20b", "model.path=null"]).model
    given = model.hf_config
    model_cls, cfg, _ = model_config(open_model(model, dummy=True))
    abstract = nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(0)))  # shapes only: no memory
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    print(f"gpt_oss_20b: {count:,} parameters")  # -rP
    assert abs(count - 20.91e9) <= 0.005 * 20.91e9
    theirs = transformers.GptOssConfig(**{k: v for k, v in given.items() if k not in ("architectures", "rope_scaling", "rope_theta")},
                                       rope_parameters={**given["rope_scaling"], "rope_theta": given["rope_theta"]})
    assert cfg.windows == tuple(128 if kind == "sliding_attention" else 0 for kind in theirs.layer_types)
    assert (cfg.layers, cfg.dim, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.experts, cfg.top_k, cfg.vocab, cfg.swiglu_limit) == (
        24, 2880, 64, 8, 64, 32, 4, 201088, 7.0)
    assert (cfg.rope_theta, cfg.rope_scaling.factor, cfg.rope_scaling.attention_factor) == (150000.0, 32.0, 0.1 * np.log(32) + 1)
    saved = theirs.to_dict()
    saved["architectures"] = given["architectures"]
    check_hf_config(given, Checkpoint(Path("config.json saved by transformers"), with_implicit_keys(saved), (), lambda name: None))


@pytest.mark.parametrize("overrides, message", [
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 150000.0, "factor": 2.0}), "with rope_type 'linear' is not supported"),
    (dict(rope_parameters={**NUMBERS["rope_parameters"], "partial_rotary_factor": 0.5}),
     "with partial_rotary_factor 0.5 is not supported"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "with layer_types ['chunked_attention'] is not supported"),
    (dict(num_experts_per_tok=9), "with num_experts_per_tok 9 of num_local_experts 8 is not supported"),
])
def test_a_config_asking_for_what_is_not_implemented_is_refused(tmp_path, overrides, message):
    config = {**NUMBERS, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **overrides}
    assert_refused(tmp_path, config, "GptOss", message)
