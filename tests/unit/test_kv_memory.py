"""jaxstream/kv_memory.py: the KV cache's bytes per token from a config's numbers, and the page pool
scheduler.kv_cache_memory_gib holds, sized before any service starts (jaxstream/preflight.py) or
refused naming the key. Held equal to what the worker allocates by tests/worker/test_kv_memory.py."""

import json

import pytest

from jaxstream.config import ConfigError, load_config
from jaxstream.architectures import head_dim
from jaxstream.kv_memory import GIB, kv_bytes_per_token, kv_dtype_bytes, state_bytes_per_slot
from jaxstream.preflight import preflight

# DeepSeek-V3's released config.json, the numbers the KV cache's size depends on (and the standard
# attention numbers beside them, which a latent cache does not read)
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61,
               "hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
               "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
SMOLLM2 = 30 * 2 * 3 * 64  # the bundled GGUF: layers x (k, v) x KV heads x head_dim, numbers a token


def sized(overrides: list[str]) -> int:
    cfg = load_config(overrides)
    preflight(cfg)
    return cfg.scheduler.num_pages


def test_a_latent_cache_holds_kv_lora_rank_and_the_rotary_part_per_layer():
    assert kv_bytes_per_token(DEEPSEEK_V3, 2) == 61 * (512 + 64) * 2 == 70272
    assert kv_bytes_per_token(DEEPSEEK_V3, 4) == 61 * 576 * 4
    for name in ("deepseek_v2_lite", "moonlight_16b_a3b"):
        assert kv_bytes_per_token(load_config([f"model={name}", "model.path=null"]).model.hf_config, 2) == 27 * 576 * 2


def test_standard_attention_holds_a_key_and_a_value_per_kv_head_and_layer():
    qwen3_8b = load_config(["model=qwen3_8b", "model.path=null"]).model.hf_config
    assert kv_bytes_per_token(qwen3_8b, 2) == 36 * 2 * 8 * 128 * 2
    # head_dim as transformers defaults it where a config leaves it out; KV heads default to the heads
    assert head_dim({"model_type": "gemma2", "hidden_size": 3584, "num_attention_heads": 16}) == 256
    assert head_dim({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32}) == 128
    assert kv_bytes_per_token({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}, 4) == 2 * 2 * 4 * 16 * 4
    assert (kv_dtype_bytes("float32", "auto"), kv_dtype_bytes("float32", "bfloat16"), kv_dtype_bytes("bfloat16", "auto")) == (4, 2, 2)


def test_the_memory_sizes_the_pool_in_every_process_by_the_models_bytes_per_token():
    assert load_config([]).scheduler.num_pages == 1024  # neither key: the default pool
    gib = 256 * 16 * SMOLLM2 * 4 / GIB  # 256 pages of 16 float32 tokens, exactly
    assert sized([f"scheduler.kv_cache_memory_gib={gib}"]) == 256
    assert sized([f"scheduler.kv_cache_memory_gib={gib}", "worker.kv_cache_dtype=bfloat16"]) == 512
    assert sized([f"scheduler.kv_cache_memory_gib={gib * 0.999}"]) == 255  # floor: never more than the memory
    assert sized([f"scheduler.kv_cache_memory_gib={gib}", "scheduler.page_size=32"]) == 128
    assert sized([f"scheduler.kv_cache_memory_gib={gib}", "worker=fake"]) == 256  # the fake worker's scheduler alike
    tiny = 4 * 40 * 4  # deepseek_v3_tiny: 4 layers x (32 + 8) latent numbers, float32
    assert sized(["model=deepseek_v3_tiny", f"scheduler.kv_cache_memory_gib={100 * 16 * tiny / GIB}", "worker=fake"]) == 100


def test_the_pool_sized_twice_is_a_config_error_naming_both_keys():
    with pytest.raises(ConfigError, match=r"^scheduler.num_pages: \(64\) and scheduler.kv_cache_memory_gib \(1.0\) both size"):
        load_config(["scheduler.num_pages=64", "scheduler.kv_cache_memory_gib=1"])
    with pytest.raises(ConfigError, match=r"^scheduler.kv_cache_memory_gib: must be > 0"):
        load_config(["scheduler.kv_cache_memory_gib=0"])


def test_a_memory_that_holds_no_page_or_a_model_that_cannot_say_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^scheduler.kv_cache_memory_gib: 1e-06 GiB holds no page of 16 tokens at 46080 bytes"):
        sized(["scheduler.kv_cache_memory_gib=0.000001"])
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4}))
    with pytest.raises(ConfigError, match=r"^scheduler.kv_cache_memory_gib: sizing the KV pool needs the model's num_hidden_layers"):
        sized([f"model.path={tmp_path}", "scheduler.kv_cache_memory_gib=1"])


# qwen3_5_tiny: one full-attention layer of 2 KV heads of 16, three linear layers (conv width 4,
# 2 key heads and 4 value heads of 16: C = 2 x 2 x 16 + 4 x 16 = 128 channels)
HYBRID_PAGE_BYTES = 1 * 2 * 2 * 16 * 4  # float32, a token
HYBRID_STATE_BYTES = 3 * (3 * 128 + 4 * 16 * 16) * 4  # float32, a request slot


def test_a_hybrid_holds_pages_for_its_full_layers_and_a_state_per_slot_for_its_linear_ones():
    tiny = load_config(["model=qwen3_5_tiny"]).model.hf_config
    assert kv_bytes_per_token(tiny, 4) == HYBRID_PAGE_BYTES
    assert state_bytes_per_slot(tiny) == HYBRID_STATE_BYTES
    assert state_bytes_per_slot(load_config(["model=qwen3_tiny"]).model.hf_config) == 0  # no linear layer
    # Without layer_types, transformers' default: every 4th layer full (full_attention_interval)
    implicit = {k: v for k, v in tiny.items() if k != "layer_types"}
    assert (kv_bytes_per_token(implicit, 4), state_bytes_per_slot(implicit)) == (HYBRID_PAGE_BYTES, HYBRID_STATE_BYTES)


def test_a_hybrids_states_come_out_of_the_memory_before_the_pages():
    slots = 8
    states = slots * HYBRID_STATE_BYTES
    gib = (states + 100 * 16 * HYBRID_PAGE_BYTES) / GIB  # the states and 100 pages of 16 tokens, exactly
    hybrid = ["model=qwen3_5_tiny", f"scheduler.max_running_requests={slots}", "scheduler.prefix_cache=false"]
    assert sized([*hybrid, f"scheduler.kv_cache_memory_gib={gib}"]) == 100
    assert sized([*hybrid, f"scheduler.kv_cache_memory_gib={gib}", "scheduler.max_running_requests=16"]) < 100
    with pytest.raises(ConfigError, match=r"^scheduler.kv_cache_memory_gib: .* GiB holds no page of 16 tokens at 256 bytes a token "
                                          r"beside the linear layers' states \(8 slots, scheduler.max_running_requests, x 16896 bytes\)"):
        sized([*hybrid, f"scheduler.kv_cache_memory_gib={states / GIB}"])


def test_jaxstream_config_shows_the_pages_and_a_hybrids_states(capsys):
    from stack.cli import main  # noqa: PLC0415

    assert main(["config", "model=qwen3_5_tiny", "scheduler.prefix_cache=false", "scheduler.max_running_requests=8",
                 "scheduler.num_pages=100"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"# KV pages: 100 of 16 tokens at {HYBRID_PAGE_BYTES} bytes a token, 0.4 MB; recurrent states: 8 slots "
        f"(scheduler.max_running_requests) of {HYBRID_STATE_BYTES} bytes, 0.1 MB")
