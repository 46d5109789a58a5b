"""Checkpoint readers: a GGUF file or a Hugging Face directory, seen the same way.

    open_checkpoint(path) -> Checkpoint(path, config, names)
    checkpoint.read(name) -> one tensor as numpy, in Hugging Face layout ([out, in] for a Linear)

`config` is a Hugging Face config.json-style dict and `names` are Hugging Face tensor names, whatever
the file; so a model maps names once. Reading is lazy: only `read` dequantizes or copies, one tensor
at a time, so a loader can show progress and never holds more than one host copy.

A GGUF tensor reads as float32 (dequantized); a safetensors tensor keeps its stored dtype (float32,
float16, ml_dtypes.bfloat16, or an integer type).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jaxstream.config import ConfigError
from jaxstream.model_files import resolve_model_path
from jaxstream.protocol import LOAD_FORMATS


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message names the path, and the tensor or key."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: dict  # Hugging Face config.json keys: hidden_size, num_hidden_layers, rope_theta, ...
    names: tuple[str, ...] = field(repr=False)  # e.g. "model.layers.0.self_attn.q_proj.weight"
    _read: Callable[[str], np.ndarray] = field(repr=False, compare=False)

    def read(self, name: str) -> np.ndarray:
        """One tensor, freshly allocated (the caller may keep or modify it)."""
        if name not in self.names:
            near = difflib.get_close_matches(name, self.names, n=3)
            hint = f"; close names: {near}" if near else ""
            raise CheckpointError(f"{self.path}: no tensor {name!r}{hint}")
        return self._read(name)




def open_checkpoint(path: str | Path, load_format: str | None = None, key: str = "model.path") -> Checkpoint:
    """A GGUF file, a Hugging Face directory, or `package:<module>` (a GGUF inside a package).
    `load_format` (None or "auto": either) says which the path must be, checked before reading it.
    `key`: what a path that does not exist is named as (the config key, or a request's field)."""
    if load_format not in (None, *LOAD_FORMATS):
        raise CheckpointError(f"load_format {load_format!r} is not one of {list(LOAD_FORMATS)}")
    try:
        resolved = resolve_model_path(str(path), key)
    except ConfigError as e:
        raise CheckpointError(str(e)) from e
    kind = "safetensors" if resolved.is_dir() else "gguf" if resolved.suffix == ".gguf" else None
    if load_format in ("safetensors", "gguf") and kind != load_format:
        wanted = "a Hugging Face directory" if load_format == "safetensors" else "a .gguf file"
        raise CheckpointError(f"{resolved}: load_format {load_format!r} needs {wanted}")
    # The readers import Checkpoint from here, so they are imported once it exists.
    if resolved.is_dir():
        from worker_svc.weights.hf_dir import open_hf_dir

        return open_hf_dir(resolved)
    if resolved.suffix == ".gguf":
        from worker_svc.weights.gguf_file import open_gguf

        return open_gguf(resolved)
    raise CheckpointError(f"{resolved}: neither a .gguf file nor a Hugging Face directory")
