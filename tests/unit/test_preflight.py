"""jaxstream/preflight.py: what only the model's files show is refused before anything starts, one
ConfigError naming the key, as the worker would refuse it later; what the worker accepts passes."""

import json

import pytest

from jaxstream.architectures import SERVED
from jaxstream.config import ConfigError, load_config
from jaxstream.preflight import check_layout, model_numbers, preflight


def refused(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        preflight(load_config(overrides))
    return str(info.value)


def hf_dir(tmp_path, **numbers) -> str:
    """A Hugging Face directory whose config.json states `numbers` (no weights: none are read)."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **numbers}))
    return str(tmp_path)


def test_the_default_config_and_the_tiny_models_pass():
    for overrides in ([], ["model=qwen3_tiny", "parallelism=tp2"], ["model=qwen3_moe_tiny", "parallelism=tp2_ep2", "moe=ep"],
                      ["model=qwen2_tiny", "parallelism=tp4"], ["model=mistral_tiny"], ["model=mixtral_tiny", "parallelism=ep2", "moe=ep"],
                      ["model=gemma2_tiny", "parallelism=tp4"], ["model=gemma3_tiny", "parallelism=tp2"]):
        preflight(load_config(overrides))


def test_an_architecture_not_served_is_refused_naming_it_and_the_served_ones(tmp_path):
    path = hf_dir(tmp_path, architectures=["GPT2LMHeadModel"])
    assert refused([f"model.path={path}"]) == (
        f"model.path: architecture ['GPT2LMHeadModel'] of {path} is not served (served: {', '.join(SERVED)})")
    assert refused(["model=qwen3_tiny", "model.hf_config.architectures=[Gemma3ForConditionalGeneration]"]).startswith(
        "model.hf_config.architectures: architecture ['Gemma3ForConditionalGeneration'] of model.hf_config is not served (served: ")


def test_a_sliding_window_smaller_than_the_served_context_passes(tmp_path):
    """transformers slides every Mistral layer by sliding_window; the worker serves the window."""
    path = hf_dir(tmp_path, architectures=["MistralForCausalLM"], sliding_window=4096, max_position_embeddings=32768)
    preflight(load_config([f"model.path={path}", "model.max_model_len=8192"]))


def test_a_model_path_that_does_not_exist_is_refused_naming_model_path():
    assert refused(["model.path=/nonexistent/model"]) == "model.path: '/nonexistent/model' does not exist"


def test_a_model_path_that_is_neither_a_gguf_file_nor_a_directory_is_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    message = refused([f"model.path={tmp_path / 'weights.bin'}"])
    assert message.startswith("model.path: ") and "is neither a .gguf file nor a directory" in message


def test_a_tokenizer_that_does_not_exist_is_refused_naming_model_tokenizer():
    assert refused(["model.tokenizer=/nonexistent/tokenizer"]) == "model.tokenizer: '/nonexistent/tokenizer' does not exist"


def test_a_model_without_path_or_tokenizer_is_refused_naming_model_tokenizer():
    assert refused(["model=qwen3_tiny", "model.tokenizer=null"]).startswith("model.tokenizer: not set, and model.path is null")


def test_a_tensor_degree_that_does_not_divide_the_heads_of_the_gguf_is_refused():
    """SmolLM2's GGUF states 9 heads over 3 KV heads: its header alone says so."""
    message = refused(["parallelism=tp2"])
    assert message.startswith("parallelism.tensor: 2 does not divide model heads 9 (num_attention_heads of ")
    assert message.endswith(".gguf; parallelism.rules.heads is tensor)")


def test_a_tensor_degree_that_does_not_divide_the_kv_heads_of_hf_config_is_refused():
    assert refused(["model=qwen3_tiny", "parallelism=tp4"]) == (
        "parallelism.tensor: 4 does not divide model kv_heads 2 (num_key_value_heads of model.hf_config; "
        "parallelism.rules.kv_heads is tensor)")


def test_an_expert_degree_that_does_not_divide_the_experts_is_refused():
    message = refused(["model=qwen3_moe_tiny", "parallelism=ep2", "parallelism.expert=3"])
    assert message.startswith("parallelism.expert: 3 does not divide model expert 8 (num_experts of model.hf_config")


def test_expert_parallelism_for_a_dense_model_is_refused_naming_the_axis():
    assert refused(["model=qwen3_tiny", "parallelism=ep2"]).startswith(
        "parallelism.expert: 2 devices, but this model has no parameter split over them")


def test_a_mesh_axis_no_rule_maps_to_is_refused():
    assert refused(["parallelism.tensor=2"]).startswith(
        "parallelism.tensor: 2 devices, but this model has no parameter split over them (parallelism.rules maps nothing")


def test_a_directorys_config_json_gives_the_numbers(tmp_path):
    path = hf_dir(tmp_path, num_attention_heads=8, vocab_size=101)  # KV heads: the heads, as transformers reads it
    assert refused([f"model.path={path}", "parallelism=tp2"]).startswith("parallelism.tensor: 2 does not divide model vocab 101")
    preflight(load_config([f"model.path={hf_dir(tmp_path, num_attention_heads=8, vocab_size=128)}", "parallelism=tp2"]))


def test_a_directorys_config_json_that_is_not_json_is_refused_naming_model_path(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert refused([f"model.path={tmp_path}", "parallelism=tp2"]).startswith(f"model.path: {tmp_path / 'config.json'} is not valid JSON")


def test_dummy_weights_take_their_numbers_from_hf_config_not_the_file():
    """As the worker builds it (open_model): SmolLM2's 9 heads are not the model served."""
    numbers = ["+model.hf_config.architectures=[LlamaForCausalLM]", "+model.hf_config.num_attention_heads=8",
               "+model.hf_config.vocab_size=128"]
    preflight(load_config(["parallelism=tp2", "worker.weights=dummy", *numbers]))
    assert refused(["parallelism=tp2", *numbers]).startswith("parallelism.tensor: 2 does not divide model heads 9")


def test_a_pair_bucket_too_small_for_the_whole_context_is_refused_naming_the_key():
    """SmolLM2's GGUF states a context of 8192 tokens: 512 pages of 16."""
    assert refused(["worker.pair_buckets=[0,16]"]) == (
        "worker.pair_buckets: the largest (16) must hold a whole context of 512 pages "
        "(model.max_model_len 8192 / scheduler.page_size 16)")
    preflight(load_config(["worker.pair_buckets=[0,16]", "model.max_model_len=256"]))


def test_the_fake_worker_lays_out_no_mesh_and_reads_no_weights():
    preflight(load_config(["worker=fake", "parallelism=tp2", "worker.pair_buckets=[0,16]"]))



def test_deepseeks_routed_experts_are_the_experts_an_expert_axis_divides():
    """DeepSeek's configs count their experts as n_routed_experts (the shared ones are not split)."""
    cfg = load_config(["model=deepseek_v3_tiny", "parallelism=ep2", "moe=ep"])
    check_layout(cfg.parallelism, lambda: model_numbers(cfg))  # 8 routed experts over 2 devices
    cfg = load_config(["model=deepseek_v3_tiny", "parallelism=ep2", "moe=ep", "model.hf_config.n_routed_experts=7"])
    with pytest.raises(ConfigError, match=r"^parallelism.expert: 2 does not divide model expert 7"):
        check_layout(cfg.parallelism, lambda: model_numbers(cfg))


def test_a_hybrid_is_refused_with_speculation_naming_the_key_and_runs_with_the_prefix_cache():
    """Qwen3.5's linear layers keep a per-request state that a rejected draft does not restore yet;
    the prefix cache keeps snapshots of it (scheduler_svc/snapshots.py)."""
    assert refused(["model=qwen3_5_tiny", "scheduler.speculative=ngram"]).startswith(
        "scheduler.speculative: Qwen3_5ForCausalLM (model.hf_config) cannot roll back")
    preflight(load_config(["model=qwen3_5_tiny"]))
    preflight(load_config(["model=qwen3_5_tiny", "scheduler.prefix_cache=false"]))
