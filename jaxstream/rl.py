"""The trainer's side of hot weight updates: push new weights from the trainer's memory into a
running jaxstream server over HTTP, and the few admin calls around a push.

    from jaxstream import rl

    url = "http://localhost:8000"
    for step in range(steps):
        rollouts = generate(url, prompts)       # /generate, as usual
        params = train_step(params, rollouts)
        rl.pause(url, mode="retract")           # running requests go back to the queue, tokens kept
        rl.push_weights(url, named_arrays(params), weight_version=f"step-{step}")
        rl.continue_generation(url)             # and resume on the new weights
        assert rl.weight_version(url) == f"step-{step}"

An adapter goes the same way (`push_adapter`: only its LoRA tensors, by PEFT's names, with its
config): a run of POSTs to /load_lora_adapter_from_tensors into a named slot, committed between steps
with the last bucket; requests then name the adapter as a model.

A push is a run of POSTs to /update_weights_from_tensor, each one bucket of at most `bucket_bytes`
of tensors in safetensors bytes (jaxstream/safetensors.py; nothing pickled), so neither side ever
holds a second copy of the whole model. The server swaps every bucket in at once when the last one
arrives; the weight version and the cache flush apply then. A tensor is anything with `.nbytes`
that `np.asarray` takes: a JAX array is fetched to the host one bucket at a time.

Only numpy, ml_dtypes and the standard library (urllib): a trainer installs nothing for this.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlencode

import numpy as np

from jaxstream.protocol import PAUSE_MODES  # SGLang's /pause_generation modes
from jaxstream.safetensors import encode

PUSH_ROUTE = "/update_weights_from_tensor"
ADAPTER_PUSH_ROUTE = "/load_lora_adapter_from_tensors"
TIMEOUT_S = 600.0  # a bucket is hundreds of MB, and a pause waits for the running step


class WeightPushError(RuntimeError):
    """The server refused or failed a call of this module, or could not be reached; the message
    names the route and carries the server's own message. `status` is the HTTP status, if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def push_weights(
    url: str,
    tensors: Mapping[str, np.ndarray],
    *,
    bucket_bytes: int = 256 << 20,
    weight_version: str | None = None,
    flush_cache: bool = True,
    api_key: str | None = None,
    timeout: float = TIMEOUT_S,
) -> dict:
    """Every tensor to the server, bucket by bucket in the mapping's order; the last reply."""
    query = {"flush_cache": _flag(flush_cache)}
    last = {} if weight_version is None else {"weight_version": weight_version}  # applies at the swap, which the last bucket makes
    return _push(url, PUSH_ROUTE, tensors, bucket_bytes, query, last, "", api_key, timeout)


def push_adapter(
    url: str,
    lora_name: str,
    tensors: Mapping[str, np.ndarray],
    *,
    rank: int,
    alpha: float,
    target_modules: Sequence[str],
    use_rslora: bool = False,
    weight_version: str | None = None,
    bucket_bytes: int = 64 << 20,
    api_key: str | None = None,
    timeout: float = TIMEOUT_S,
) -> dict:
    """A LoRA adapter's tensors into the server's adapter `lora_name` (created on the first push,
    replaced after), bucket by bucket; the last reply. `tensors` are named as PEFT saves them
    (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` [rank, in], `...lora_B.weight`
    [out, rank]); `rank`, `alpha`, `target_modules` (PEFT's module names: q_proj, v_proj, ...) and
    `use_rslora` are its LoraConfig's r, lora_alpha, target_modules and use_rslora. The adapter
    swaps in whole with the last bucket, between steps; `weight_version` is then the server's."""
    if not lora_name:
        raise ValueError("push_adapter: lora_name must be a non-empty string")
    query = {"lora_name": lora_name, "r": str(int(rank)), "lora_alpha": repr(float(alpha)),
             "target_modules": ",".join(target_modules), "use_rslora": _flag(use_rslora)}
    last = {} if weight_version is None else {"weight_version": weight_version}
    return _push(url, ADAPTER_PUSH_ROUTE, tensors, bucket_bytes, query, last, f"adapter {lora_name!r}, ", api_key, timeout)


def _push(url: str, route: str, tensors: Mapping[str, np.ndarray], bucket_bytes: int, query: dict, last: dict,
          what: str, api_key: str | None, timeout: float) -> dict:
    """The tensors in buckets to `route`, each with `query` and `last_bucket`, the last one with `last` too."""
    runs = buckets(tensors, bucket_bytes)
    if not runs:
        raise ValueError(f"{route.strip('/')}: no tensors to push")
    for i, names in enumerate(runs):
        final = i == len(runs) - 1
        fields = {**query, "last_bucket": _flag(final), **(last if final else {})}
        body = encode({name: tensors[name] for name in names})
        try:
            reply = _call(url, "POST", f"{route}?{urlencode(fields)}", body, "application/octet-stream", api_key, timeout)
        except WeightPushError as e:
            raise WeightPushError(f"{what}bucket {i + 1} of {len(runs)}: {e}", e.status) from e
    return reply


def buckets(tensors: Mapping[str, np.ndarray], bucket_bytes: int) -> list[list[str]]:
    """The tensors' names in order, cut into runs of at most `bucket_bytes` bytes of data; a tensor
    bigger than that makes a run of its own."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    runs: list[list[str]] = []
    size = 0
    for name, tensor in tensors.items():
        if not runs or size + tensor.nbytes > bucket_bytes:
            runs.append([])
            size = 0
        runs[-1].append(name)
        size += tensor.nbytes
    return runs


def pause(url: str, mode: str = "retract", *, api_key: str | None = None, timeout: float = TIMEOUT_S) -> dict:
    """Stop generating: `abort` ends running requests, `retract` sends them back to the queue,
    `in_place` holds them where they are (SGLang's modes)."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
    return _post_json(url, "/pause_generation", {"mode": mode}, api_key, timeout)


def continue_generation(url: str, *, api_key: str | None = None, timeout: float = TIMEOUT_S) -> dict:
    return _post_json(url, "/continue_generation", {}, api_key, timeout)


def update_from_disk(
    url: str,
    path: str | Path,
    weight_version: str | None = None,
    flush_cache: bool = True,
    *,
    api_key: str | None = None,
    timeout: float = TIMEOUT_S,
) -> dict:
    """Have the server load a checkpoint it can read at `path` (on its own disk)."""
    body = {"model_path": str(path), "flush_cache": flush_cache}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return _post_json(url, "/update_weights_from_disk", body, api_key, timeout)


def list_weights(url: str, *, api_key: str | None = None, timeout: float = TIMEOUT_S) -> list[dict]:
    """The server's weights, each {"name", "shape", "dtype"}: what a push may name."""
    return _call(url, "GET", "/list_weights", None, None, api_key, timeout)["weights"]


def weight_version(url: str, *, api_key: str | None = None, timeout: float = TIMEOUT_S) -> str | None:
    return _call(url, "GET", "/get_weight_version", None, None, api_key, timeout)["weight_version"]


# --- HTTP ---


def _flag(value: bool) -> str:
    return "true" if value else "false"


def _post_json(url: str, route: str, body: dict, api_key: str | None, timeout: float) -> dict:
    return _call(url, "POST", route, json.dumps(body).encode(), "application/json", api_key, timeout)


def _call(url: str, method: str, route: str, body: bytes | None, content_type: str | None,
          api_key: str | None, timeout: float) -> dict:
    """One request; its JSON reply, or WeightPushError with the server's message."""
    headers = {"Accept": "application/json"}
    if content_type:
        headers["Content-Type"] = content_type
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    what = f"{method} {route.partition('?')[0]}"
    request = urllib.request.Request(url.rstrip("/") + route, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read()
    except urllib.error.HTTPError as e:  # before OSError: it is one, and carries the server's reply
        raise WeightPushError(f"{what}: HTTP {e.code}: {_server_message(e.read())}", e.code) from None
    except OSError as e:  # refused, reset, timed out
        raise WeightPushError(f"{what}: cannot reach {url}: {getattr(e, 'reason', e)}") from e
    try:
        reply = json.loads(text or b"{}")
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        raise WeightPushError(f"{what}: the reply is not a JSON object: {_server_message(text)}", 200)
    if reply.get("success") is False:
        raise WeightPushError(f"{what}: {_server_message(text)}", 200)
    return reply


def _server_message(text: bytes) -> str:
    """The message in an error reply: SGLang's {"success": false, "message"}, the OpenAI-style
    {"error": {"message"}}, or the body itself."""
    try:
        reply = json.loads(text)
    except ValueError:
        reply = None
    if isinstance(reply, dict):
        error = reply.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
        if "message" in reply:
            return str(reply["message"])
    return text.decode(errors="replace").strip()[:2000] or "(an empty reply)"
