"""Which attention backend a worker runs (worker.attention_backend), for its platform, its device
count and the model it serves. Every backend is the one attention interface the layers call
(layers/attention.py's `paged_attention`); they differ in the `Kernels` value start-up hands the
model's Numerics (layers/kernels.py), whose states over the cache and over a step's own keys
`paged_attention` combines:

- `native`: none; jax.numpy's page-list loop, (token, page) pairs and own-key tiles, everywhere;
- `cpu_kernel`: our C++ kernel (worker_svc/cpu_kernels/), XLA:CPU only;
- `pallas`: JAX's own Pallas kernels (worker_svc/pallas_kernels/): compiled on a GPU, in Pallas'
  interpret mode on a CPU (the same arithmetic, slowly: for tests and a check without a GPU);
- `auto`: the C++ kernel on a CPU (unless worker.attention_kernel is false: native), the Pallas
  kernels on one GPU, native on a TPU and over a mesh of several devices.

A backend the platform cannot run at all is a ConfigError naming the key. A model whose attention
the Pallas kernels do not take (a sliding window, multi-head latent attention) runs native, and
the worker logs why: the kernels take soft-capping (over the cache; the step's own keys then in
jax.numpy) and sinks (folded in after every source), not windows, and their cache is per KV head.

Not yet: TPU. JAX's ragged paged attention (tpu.ragged_paged_attention) attends a mixed step's
queries over a cache that already holds the step's keys, in its own [P, Z, 2K, H] layout; our
step writes its keys after every layer has read (a read and a write of the cache in one layer
made XLA copy it) and keeps [L, P, Z, K, H]. Meeting it is a cache layout of the engine's.
"""

from __future__ import annotations

from typing import Any

from jaxstream.architectures import every_layer_windows, gpt_oss_windows, qwen2_windows
from jaxstream.config import ConfigError
from jaxstream.config.worker import WorkerConfig

KEY = "worker.attention_backend"
# The families whose configs may make layers slide, by the reader of their windows (jaxstream/architectures.py)
WINDOWS = {"MistralForCausalLM": every_layer_windows, "MixtralForCausalLM": every_layer_windows,
           "Qwen2ForCausalLM": qwen2_windows, "GptOssForCausalLM": gpt_oss_windows}
ALWAYS_SLIDING = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")  # local and global layers by turns


def choose(worker: WorkerConfig, platform: str, devices: int, hf_config: dict[str, Any] | None = None) -> tuple[str, str]:
    """(the backend the worker runs, why where it is not what the config names or `auto` would
    pick: a line for the log, else ""). `platform`: JAX's ("cpu", "gpu", "tpu"); `devices`: the
    replica's; `hf_config`: the model's config.json numbers (None: not known, not checked)."""
    asked = worker.attention_backend
    if asked == "cpu_kernel" and platform != "cpu":
        raise ConfigError(f"{KEY}: cpu_kernel runs on the CPU platform only, and this worker's is {platform} (use auto, native or pallas)")
    if asked == "pallas" and platform == "tpu":
        raise ConfigError(f"{KEY}: pallas is not wired for TPU yet (JAX's ragged paged attention needs the step's keys in "
                          "the cache before attention, in its own layout); use auto or native")
    if asked == "pallas" and devices > 1:
        raise ConfigError(f"{KEY}: pallas runs on one device; this replica has {devices} (a Pallas call is not partitioned "
                          "over a mesh); use auto or native")
    if asked != "auto":
        backend = asked
    elif platform == "cpu":
        backend = "cpu_kernel" if worker.attention_kernel else "native"
    elif platform == "gpu" and devices == 1:
        backend = "pallas"
    else:
        return "native", f"{KEY}=auto: native attention ({'a mesh of several devices' if devices > 1 else platform})"
    if backend == "pallas" and hf_config is not None:
        lacking = lacks(hf_config)
        if lacking:
            return "native", f"{KEY}={asked}: the Pallas kernels take no {lacking}; this model runs native attention"
    return backend, ""


def lacks(hf_config: dict[str, Any]) -> str:
    """What of a model's attention the Pallas kernels do not take ("" if nothing): sliding windows,
    multi-head latent attention."""
    if hf_config.get("kv_lora_rank") is not None:
        return "multi-head latent attention (its cache is one latent per token, not keys per KV head)"
    architecture = next(iter(hf_config.get("architectures") or []), "")
    reader = WINDOWS.get(architecture)
    try:
        windows = reader(hf_config) if reader is not None else None
    except ValueError:  # layer types the model file refuses too, with its own message, as it loads
        windows = None
    if architecture in ALWAYS_SLIDING or any(windows or ()):
        return "sliding window (its layers slide)"
    return ""
