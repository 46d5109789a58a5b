"""A Hugging Face checkpoint directory: config.json plus safetensors weights.

The weights are one `model.safetensors`, or shards that `model.safetensors.index.json` lists in its
`weight_map` (tensor name -> shard file). Every shard's header is read on open, so a missing shard or
an index naming a tensor its shard lacks fails here, not halfway through loading.

config.json is returned as written, with keys filled where a config leaves them implicit, so a
model reads the same keys as from a GGUF, and as released config.json files (transformers 4) state
them: `rope_theta` and `rope_scaling` (transformers 5 writes both inside `rope_parameters`),
`num_experts` (transformers 5 writes `num_local_experts`),
`head_dim` and `num_key_value_heads` (their transformers defaults: head_dim is
hidden_size / num_attention_heads, except for Qwen3's fixed 128 and GPT-OSS's 64), and
`tie_word_embeddings` (true exactly when there is no lm_head.weight).

A checkpoint whose config says MXFP4 (GPT-OSS's released ones) reads each packed pair of tensors as
the one float tensor it stands for (mxfp4.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxstream.architectures import head_dim
from worker_svc.weights import Checkpoint, CheckpointError
from worker_svc.weights.mxfp4 import is_mxfp4, mxfp4_read
from worker_svc.weights.safetensors_file import SafetensorsFile, open_safetensors

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def open_hf_dir(path: Path) -> Checkpoint:
    config = _read_json(path / "config.json")
    if (path / INDEX).exists():
        where = _sharded(path)
    elif (path / SINGLE).exists():
        single = open_safetensors(path / SINGLE)
        where = dict.fromkeys(single.tensors, single)
    else:
        raise CheckpointError(f"{path}: holds neither {SINGLE} nor {INDEX}")
    names = tuple(where)
    config = with_implicit_keys(config)
    config.setdefault("tie_word_embeddings", "lm_head.weight" not in names)
    checkpoint = Checkpoint(path, config, names, lambda name: where[name].read(name))
    return mxfp4_read(checkpoint) if is_mxfp4(config) else checkpoint


def _sharded(path: Path) -> dict[str, SafetensorsFile]:
    weight_map = _read_json(path / INDEX).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{path / INDEX}: no weight_map")
    shards = {}
    for file in sorted(set(weight_map.values())):
        if not (path / file).is_file():
            raise CheckpointError(f"{path / INDEX}: shard {file!r} is missing from {path}")
        shards[file] = open_safetensors(path / file)
    for name, file in weight_map.items():
        if name not in shards[file].tensors:
            raise CheckpointError(f"{path / INDEX}: maps {name!r} to {file!r}, which does not hold it")
    return {name: shards[file] for name, file in weight_map.items()}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return value


def with_implicit_keys(config: dict) -> dict:
    """A copy with the keys every model reads filled from those a config may state instead (all but
    tie_word_embeddings, which a directory answers by its tensors)."""
    config = dict(config)
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    if "rope_scaling" not in config and rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = {key: value for key, value in rope.items() if key != "rope_theta"}
    if "num_experts" not in config and "num_local_experts" in config:  # transformers 5's name, for Qwen3-MoE
        config["num_experts"] = config["num_local_experts"]
    if "num_attention_heads" in config:
        config.setdefault("num_key_value_heads", config["num_attention_heads"])
        if "hidden_size" in config:
            config["head_dim"] = head_dim(config)  # transformers' default where the config states none
    return config
