"""examples/grpo/model.py, the trainer's Qwen3-MoE: against Hugging Face transformers on the same
weights (read through `from_hf` from what transformers saves), its names and layouts round-tripped,
and routing replay: replaying its own choices changes nothing, replaying others changes the output
and still trains the router. Also the loop's arithmetic (examples/grpo/train.py): the R3 decoding,
rewards and group advantages."""

import base64

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from examples.grpo import train
from examples.grpo.model import forward, from_hf, init_params, to_hf, token_logprobs
from jaxstream.config import load_config
from tests.model.parity import redraw
from worker_svc.models.qwen3_moe import Qwen3MoeConfig

CONFIG = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=128,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, tie_word_embeddings=True)
TOKENS = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], 21)


def config(**overrides) -> Qwen3MoeConfig:
    return Qwen3MoeConfig.from_hf({**CONFIG, **overrides})


@pytest.mark.parametrize("overrides", [dict(norm_topk_prob=True, mlp_only_layers=[1]), dict(norm_topk_prob=False)],
                         ids=["normed_dense_layer_1", "unnormed_all_moe"])
def test_logits_match_transformers_on_its_saved_weights(tmp_path, overrides):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = redraw(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**CONFIG, **overrides)))
    hf.save_pretrained(tmp_path)
    tensors = {name: t for f in sorted(tmp_path.glob("*.safetensors")) for name, t in load_file(str(f)).items()}
    cfg = config(**overrides)
    params = from_hf(tensors, cfg)
    assert to_hf(params, cfg).keys() == tensors.keys()  # every tensor read, none invented
    ours, _ = forward(params, cfg, jnp.asarray(TOKENS))
    with torch.no_grad():
        theirs = hf(torch.tensor([TOKENS.tolist()])).logits[0].numpy()
    diff = np.abs(np.asarray(ours) - theirs).max()
    print(f"max |logit diff| vs transformers: {diff:.2e} (logit std {theirs.std():.2f})")  # -rP
    assert diff <= 1e-4


def test_hf_names_and_layouts_round_trip():
    cfg = config(mlp_only_layers=[1])
    params = init_params(cfg, 3)
    tensors = to_hf(params, cfg)
    assert tensors["model.layers.0.mlp.gate.weight"].shape == (8, 64)  # [E, D], the router
    assert tensors["model.layers.0.mlp.experts.7.down_proj.weight"].shape == (64, 32)  # [D, F]
    assert tensors["model.layers.1.mlp.gate_proj.weight"].shape == (96, 64)  # the dense layer's [F, D]
    assert tensors["model.layers.2.self_attn.q_proj.weight"].shape == (64, 64)  # [N*H, D]
    assert "lm_head.weight" not in tensors  # tied
    back = from_hf(tensors, cfg)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), params, back))


def test_replaying_the_own_routing_gives_identical_logits():
    cfg = config(norm_topk_prob=True, mlp_only_layers=[1])
    params = init_params(cfg, 1, embed_std=1.0)
    logits, used = forward(params, cfg, jnp.asarray(TOKENS))
    assert used.shape == (len(TOKENS), 3, 2) and (np.asarray(used[:, 1]) == -1).all()  # -1: the dense layer
    assert (np.asarray(used[:, (0, 2)]) >= 0).all()
    replayed, again = forward(params, cfg, jnp.asarray(TOKENS), used)
    assert (np.asarray(replayed) == np.asarray(logits)).all() and (np.asarray(again) == np.asarray(used)).all()
    unknown = jnp.full_like(used, -1)  # nothing given: the trainer's own top-k, everywhere
    assert (np.asarray(forward(params, cfg, jnp.asarray(TOKENS), unknown)[0]) == np.asarray(logits)).all()


def test_replaying_other_experts_changes_the_output_and_trains_the_router():
    cfg = config(norm_topk_prob=True)
    params = init_params(cfg, 2, embed_std=1.0)
    tokens = jnp.asarray(TOKENS)
    _, used = forward(params, cfg, tokens)
    other = (used + 1) % cfg.experts  # every choice moved to the next expert
    logits, replayed = forward(params, cfg, tokens, other)
    assert (np.asarray(replayed) == np.asarray(other)).all()
    assert np.abs(np.asarray(logits) - np.asarray(forward(params, cfg, tokens)[0])).max() > 1e-3

    def loss(router):
        layers = [{**p, "mlp.router.w": router} if i == 0 else p for i, p in enumerate(params["layers"])]
        logits, _ = forward({**params, "layers": layers}, cfg, tokens, other)
        return token_logprobs(logits[:-1], tokens[1:]).sum()

    grad = jax.grad(loss)(params["layers"][0]["mlp.router.w"])
    assert np.abs(np.asarray(grad)).max() > 0


def test_token_logprobs_are_log_softmax_over_the_whole_vocabulary():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(5, 300)) * 3, jnp.float32)
    targets = jnp.asarray([0, 7, 299, 3, 3])
    expected = jax.nn.log_softmax(logits)[jnp.arange(5), targets]
    assert np.abs(np.asarray(token_logprobs(logits, targets)) - np.asarray(expected)).max() <= 1e-6


def test_routed_experts_decode_the_stated_shape_and_pad_the_last_token():
    cfg = Qwen3MoeConfig.from_hf(dict(load_config(["model=qwen3_moe_tiny"]).model.hf_config))  # 2 layers, dense layer 1
    seq = 5
    rows = np.arange((seq - 1) * 2 * 2, dtype="<i4").reshape(seq - 1, 2, 2)
    meta = {"routed_experts": base64.b64encode(rows.tobytes()).decode(), "routed_experts_shape": [seq - 1, 2, 2],
            "routed_experts_start_len": 0}
    out = train.routed_experts(meta, seq, cfg)
    assert out.shape == (seq, 2, 2) and (out[:-1] == rows).all() and (out[-1] == -1).all()
    assert (train.routed_experts({}, seq, cfg) == -1).all()


def test_rewards_and_group_advantages():
    target = np.zeros(10, bool)
    target[[2, 3]] = True
    completions = np.array([[2, 3, 0, 0], [1, 1, 1, 1], [2, 2, 2, 2], [3, 0, 0, 0]])
    reward = train.rewards(completions, target)
    assert reward.tolist() == [0.5, 0.0, 1.0, 0.25]
    adv = train.advantages(reward, group=2)
    assert np.allclose(adv, [1, -1, 1, -1], atol=1e-5)  # each group: one above its mean, one below
    assert np.allclose(train.advantages(np.ones(4), group=2), 0)  # a group all alike teaches nothing
