"""A GGUF file (llama.cpp's format) read as a Hugging Face checkpoint.

1. `jaxstream/gguf_header.py` reads the metadata and tensor table (0.1 s, where `gguf.GGUFReader`
   takes ~3), and the file is mapped: a tensor is read from the map only when asked for.
2. The metadata becomes a config.json-style dict; GGUF tensor names become Hugging Face names through
   the architecture's table below (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`).
3. `read` dequantizes one tensor to float32. GGUF lists a shape fastest-axis first ([in, out] for a
   Linear), which is numpy's [out, in] reversed, so the rows already are Hugging Face's rows.
4. For llama, llama.cpp's converter permuted the rows of Q and K (see `unpermute_rotary`); `read`
   undoes that, as transformers' GGUF loader does.

Norm weights are stored as F32 and come back unchanged; the embedding is often Q8_0 and the Linears
Q4/Q5/Q6/Q8; every quantization `gguf.quants` knows is read. Q8_0 (blocks of 32 int8 values with a
float16 scale each) too, dequantized like the rest: under worker.quantization=int8 the loader then
requantizes per output channel (layers/quantized.py), since a block's scale is not a channel's, so
the int8 values served are not the file's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from jaxstream.gguf_header import GGUFError, TensorInfo, read_header
from worker_svc.weights import Checkpoint, CheckpointError

# GGUF name stem (without ".weight" / ".bias") -> Hugging Face name stem.
TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LLAMA_BLOCK = {  # inside blk.N -> model.layers.N
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class Architecture:
    hf_class: str
    model_type: str
    block: dict[str, str]
    # llama.cpp's converter permutes Q and K rows for this architecture (its rotary pairs are
    # interleaved); Hugging Face keeps each head's two rotary halves apart.
    permuted_qk: bool


ARCHITECTURES = {  # keyed by general.architecture
    "llama": Architecture("LlamaForCausalLM", "llama", LLAMA_BLOCK, permuted_qk=True),
    # Qwen3 is llama plus an RMSNorm on each head's q and k, with no permutation in the file.
    "qwen3": Architecture(
        "Qwen3ForCausalLM", "qwen3",
        LLAMA_BLOCK | {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
        permuted_qk=False,
    ),
}


@dataclass(frozen=True)
class Source:
    tensor: TensorInfo
    kind: gguf.GGMLQuantizationType
    data: np.ndarray  # its bytes in the file's map: uint8, [rows..., bytes of a row] when quantized
    rotary_heads: int | None  # heads to unpermute over (Q: q heads, K: kv heads), else None


def open_gguf(path: Path) -> Checkpoint:
    try:
        header = read_header(path)
    except (GGUFError, OSError) as e:  # bad magic, or a file shorter than its tables
        raise CheckpointError(f"{path}: not a GGUF file, or a truncated one ({e})") from e
    if header.byte_order != "<":
        raise CheckpointError(f"{path}: a big-endian GGUF file; only little-endian ones are read")
    meta = header.metadata
    arch_name = meta.get("general.architecture")
    arch = ARCHITECTURES.get(arch_name)
    if arch is None:
        supported = ", ".join(ARCHITECTURES)
        raise CheckpointError(f"{path}: GGUF architecture {arch_name!r} is not supported (supported: {supported})")
    config = _config(path, meta, arch_name, arch, header.tensors)
    mapped = np.memmap(path, np.uint8, "r")
    sources = {}
    for tensor in header.tensors:
        stem, _, suffix = tensor.name.rpartition(".")
        hf_stem = _hf_stem(stem, arch)
        if hf_stem is None:
            raise CheckpointError(f"{path}: GGUF tensor {tensor.name!r} has no Hugging Face name for {arch_name}")
        sources[f"{hf_stem}.{suffix}"] = Source(tensor, *_data(path, mapped, tensor), _rotary_heads(stem, arch, config))

    def read(name: str) -> np.ndarray:
        return _read(path, name, sources[name])

    return Checkpoint(path, config, tuple(sources), read)


def unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: rows [N, H/2, 2] (pairs interleaved) -> [N, 2, H/2].

    Within each head, llama.cpp orders rows (0, H/2, 1, H/2+1, ...), so that rotary pairs sit side
    by side; Hugging Face's rotate_half orders them (0, 1, ..., H/2-1, H/2, ...). Works on a weight
    [N*H, D] and on a bias [N*H] alike.
    """
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_stem(stem: str, arch: Architecture) -> str | None:
    if not stem.startswith("blk."):
        return TOP_LEVEL.get(stem)
    _, layer, part = (stem.split(".", 2) + [""])[:3]  # blk.N.part
    return f"model.layers.{layer}.{arch.block[part]}" if part in arch.block else None


def _rotary_heads(stem: str, arch: Architecture, config: dict) -> int | None:
    if not arch.permuted_qk:
        return None
    part = stem.rsplit(".", 1)[-1]
    return {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}.get(part)


def _data(path: Path, mapped: np.ndarray, tensor: TensorInfo) -> tuple[gguf.GGMLQuantizationType, np.ndarray]:
    """The tensor's type, and its bytes in the map shaped as `gguf.quants.dequantize` takes them."""
    try:
        kind = gguf.GGMLQuantizationType(tensor.ggml_type)
    except ValueError:
        raise CheckpointError(f"{path}: GGUF tensor {tensor.name!r} has unknown ggml type {tensor.ggml_type}") from None
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    shape = tuple(reversed(tensor.dims))
    if shape[-1] % block:
        raise CheckpointError(f"{path}: GGUF tensor {tensor.name!r}'s rows of {shape[-1]} values are not whole {kind.name} blocks")
    end = tensor.offset + int(np.prod(shape)) // block * block_bytes
    if end > mapped.size:
        raise CheckpointError(f"{path}: not a GGUF file, or a truncated one (tensor {tensor.name!r} ends at byte {end}, "
                              f"the file at {mapped.size})")
    data = mapped[tensor.offset:end]
    return kind, data if block == 1 else data.reshape(gguf.quant_shape_to_byte_shape(shape, kind))


def _read(path: Path, name: str, source: Source) -> np.ndarray:
    tensor = source.tensor
    try:
        w = gguf.quants.dequantize(source.data, source.kind)
    except NotImplementedError as e:
        raise CheckpointError(f"{path}: tensor {name!r} ({tensor.name}) is {source.kind.name}, which gguf cannot dequantize") from e
    w = w.reshape(tuple(reversed(tensor.dims)))  # GGUF dims list the fastest axis first
    if source.rotary_heads is not None:
        w = unpermute_rotary(w, source.rotary_heads)
    return np.array(w, dtype=np.float32)  # a copy: F32 tensors dequantize to a view of the file


def _config(path: Path, meta: dict, arch_name: str, arch: Architecture, tensors: list[TensorInfo]) -> dict:
    def need(key: str) -> Any:
        if key not in meta:
            raise CheckpointError(f"{path}: GGUF metadata lacks {key!r}")
        return meta[key]

    hidden = need(f"{arch_name}.embedding_length")
    heads = need(f"{arch_name}.attention.head_count")
    names = {t.name: t for t in tensors}
    if "token_embd.weight" not in names:
        raise CheckpointError(f"{path}: GGUF file has no token_embd.weight")
    return {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": need(f"{arch_name}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch_name}.attention.head_count_kv", heads),
        # key_length where the converter wrote one (qwen3 does, as its head_dim is not hidden/heads).
        "head_dim": meta.get(f"{arch_name}.attention.key_length", hidden // heads),
        "intermediate_size": need(f"{arch_name}.feed_forward_length"),
        "rope_theta": meta.get(f"{arch_name}.rope.freq_base", 10000.0),
        "rms_norm_eps": need(f"{arch_name}.attention.layer_norm_rms_epsilon"),
        # The embedding's row count where the metadata does not say (llama.cpp often omits it).
        "vocab_size": meta.get(f"{arch_name}.vocab_size", names["token_embd.weight"].dims[-1]),
        "max_position_embeddings": need(f"{arch_name}.context_length"),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
