"""The RL control surface, in SGLang's request and response shapes (docs/design.md, RL surface):
pause and continue, weight updates from disk or from the trainer's tensors, weight versions, the
checkpoint's tensor names, and releasing device memory.

A weight update runs in two phases on every replica (scheduler_svc/control.py, worker_svc/control.py):
1. stage: each worker loads the new weights beside the live ones and checks them, while serving
   goes on. One refusal (a missing tensor, a wrong shape) drops every replica's staging: the old
   weights keep serving everywhere, and the client gets a 400 naming the tensor.
2. commit: new requests wait at the gateways (gate.py); each scheduler lets its running requests
   finish (unless paused), then its worker swaps, sets the version and empties the prefix cache.
Tensors come as safetensors bytes, never pickles; the gateway leaves them in Redis in parts (at
most MAX_BUCKET_BYTES a request, deleted once every worker has staged them) and names the parts
in the stage message: Redis carries the bytes, never a message of gigabytes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from functools import partial

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import ApiError, invalid, log_rejected
from gateway.gate import PAUSED, RELEASED, RELEASING, UPDATE
from gateway.generation import Pipeline
from gateway.http import read_body
from gateway.body import parse_json, read_bounded
from gateway.params import check, get
from jaxstream import protocol
from jaxstream.safetensors import SafetensorsError, read_header

PAUSE_TIMEOUT_S = 60.0  # a scheduler answers within one loop iteration
UPDATE_TIMEOUT_S = 1800.0  # a worker loading a large checkpoint; a worker that dies fails it sooner
DEVICE = ("scheduler", "worker")  # who must be running for what the worker does
MAX_BUCKET_BYTES = 1 << 30  # one /update_weights_from_tensor request's tensors
BLOB_PART_BYTES = 16 << 20
BLOB_TTL_S = UPDATE_TIMEOUT_S


def refused(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    """SGLang's failure (`success: false` and a message) in OpenAI's error shape too."""
    return JSONResponse({"success": False, "message": message, **ApiError(status, message, param).body()}, status_code=status)


def sglang_failures(route):
    """A weight route's refusals (bad input included) answer as SGLang's do, with `success: false`."""
    async def answer(self, request: Request) -> Response:
        try:
            return await route(self, request)
        except ApiError as exc:
            if exc.status in (408, 499):  # the body never came whole: the app's answer, which closes the connection
                raise
            log_rejected(request, exc)
            return refused(exc.message, exc.status, exc.param)
    return answer


class RLRoutes:
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.bus = pipeline.bus
        self.updating = asyncio.Lock()  # one weight update at a time through this gateway

    # -- pause and continue

    async def pause(self, request: Request) -> Response:
        body = await read_body(request)
        mode = get(body, "mode", str, "abort")
        check(mode in protocol.PAUSE_MODES, "mode", f"must be one of {list(protocol.PAUSE_MODES)}, got {mode!r}")
        if failed := await self.pause_replicas(mode):
            return refused(failed)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: Request) -> Response:
        await read_body_or_empty(request)
        await self.continue_replicas()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def pause_replicas(self, mode: str) -> str:
        """Every replica paused in `mode` (one of protocol.PAUSE_MODES): "", or why not."""
        await self.bus.set_hold(PAUSED)  # first: no new request enters while the replicas pause
        replies = await self.pipeline.control(lambda rid: protocol.PauseGeneration(rid, self.bus.name, mode), PAUSE_TIMEOUT_S)
        return "; ".join(r.message for r in replies if not r.ok)

    async def continue_replicas(self) -> None:
        await self.pipeline.control(lambda rid: protocol.ContinueGeneration(rid, self.bus.name), PAUSE_TIMEOUT_S)
        await self.bus.clear_hold(PAUSED)  # last: the held requests find the replicas stepping

    # -- weight updates

    @sglang_failures
    async def update_from_disk(self, request: Request) -> Response:
        body = await read_body(request)
        path = get(body, "model_path", str, None)
        check(bool(path), "model_path", "must name a checkpoint: a Hugging Face directory or a .gguf file")
        load_format = get(body, "load_format", str, None)
        check(load_format in (None, *protocol.LOAD_FORMATS), "load_format", f"must be one of {list(protocol.LOAD_FORMATS)}, got {load_format!r}")
        commit = _commit_fields(body)
        abort = get(body, "abort_all_requests", bool, False)
        async with self.updating:
            if abort:
                await self.pipeline.abort_all("aborted by a weight update (abort_all_requests)")
            stage = partial(protocol.UpdateWeights, gateway=self.bus.name, phase="stage", path=path, load_format=load_format)
            if failure := await self._stage(stage):
                return failure
            return await self._commit(*commit, f"weights loaded from {path}")

    @sglang_failures
    async def update_from_tensor(self, request: Request) -> Response:
        """The tensors of one bucket as safetensors bytes: the raw body (any content type but JSON;
        the fields as query parameters), or JSON with `serialized_named_tensors`, a list of base64
        safetensors buffers. The swap happens with the bucket whose `last_bucket` is true (the
        default: one request, one whole update)."""
        if request.headers.get("content-type", "").startswith("application/json"):
            body = parse_json(await bounded_body(request), request.app.state.limits.max_json_depth)
            buffers = [safetensors_bytes(b, "serialized_named_tensors") for b in base64_buffers(body.get("serialized_named_tensors"))]
            load_format = get(body, "load_format", str, None)
            check(load_format in (None, "safetensors"), "load_format",
                  f"must be 'safetensors' (or absent): the tensors are safetensors bytes, never pickles; got {load_format!r}")
        else:
            body = query_fields(request)
            buffers = [await bounded_body(request)]
            check(len(buffers[0]) > 0, "body", "must hold the tensors as safetensors bytes")
            safetensors_bytes(buffers[0], "body")
        last = get(body, "last_bucket", bool, True)
        commit = _commit_fields(body)  # checked before anything is staged
        async with self.updating:
            keys: list[tuple[str, ...]] = []
            try:
                for i, data in enumerate(buffers):
                    keys.append(await self.bus.put_blob(f"{self.pipeline.new_rid()}:{i}", data, BLOB_PART_BYTES, BLOB_TTL_S))
                for parts in keys:
                    if failure := await self._stage(partial(protocol.UpdateWeights, gateway=self.bus.name, phase="stage", blobs=parts)):
                        return failure
            finally:
                for parts in keys:
                    await self.bus.delete_keys(parts)
            if not last:
                return JSONResponse({"success": True, "message": "bucket staged; the weights swap with the last bucket"})
            return await self._commit(*commit, "weights updated from tensors")

    @sglang_failures
    async def update_version(self, request: Request) -> Response:
        body = await read_body(request)
        version = get(body, "new_version", str, None)
        check(bool(version), "new_version", "must be a non-empty string")
        if get(body, "abort_all_requests", bool, True):
            await self.pipeline.abort_all("aborted by /update_weight_version")
        async with self.updating:
            response = await self._commit(version, False, "weight version set")  # the weights stay: so does their KV
        if response.status_code == 200:
            return JSONResponse({"success": True, "message": f"weight version set to {version!r}", "new_version": version})
        return response

    async def _stage(self, stage) -> Response | None:
        """Every replica stages, or none keeps what it staged: None, or the refusal to answer."""
        replies = await self.pipeline.control(stage, UPDATE_TIMEOUT_S, DEVICE)
        if all(r.ok for r in replies):
            return None
        await self.pipeline.control(lambda rid: protocol.UpdateWeights(rid, self.bus.name, "discard"), UPDATE_TIMEOUT_S, DEVICE)
        return refused(said(r for r in replies if not r.ok))

    async def _commit(self, version: str | None, flush: bool, done: str) -> Response:
        """Every replica swaps in what it staged (a version-only commit: none), once its running
        requests finished, while new ones wait at the gateways."""
        async with self.pipeline.gate.holding(f"{UPDATE}{self.pipeline.new_rid()}"):
            replies = await self.pipeline.control(
                lambda rid: protocol.UpdateWeights(rid, self.bus.name, "commit", version=version, flush_cache=flush), UPDATE_TIMEOUT_S,
                DEVICE)
        if failed := [r for r in replies if not r.ok]:
            return refused(said(failed), 500)  # staged everywhere, yet a swap failed: the replicas may now differ
        held = sum(r.requests for r in replies) + self.pipeline.gate.held
        self.pipeline.version_seen = replies[0].weight_version
        return JSONResponse({"success": True, "message": f"{done}; weight version {replies[0].weight_version!r}",
                             "num_paused_requests": held})

    async def weight_version(self, request: Request) -> Response:
        return JSONResponse({"weight_version": await self.pipeline.weight_version()})

    async def list_weights(self, request: Request) -> Response:
        """Every checkpoint tensor the model reads (name, shape in the checkpoint's layout, dtype
        served), for a trainer to check its names before the first push. `?prefix=` filters."""
        raw = await self.bus.get_value(self.bus.keys.weight_names)
        if raw is None:
            raise ApiError(503, "no worker has published its weights' names yet")
        prefix = request.query_params.get("prefix", "")
        weights = [{"name": n, "shape": list(shape), "dtype": dtype} for n, shape, dtype in json.loads(raw) if n.startswith(prefix)]
        return JSONResponse({"success": True, "message": "", "weights": weights})

    # -- memory

    async def release_memory(self, request: Request) -> Response:
        if failed := await self.release_tags(_tags(await read_body_or_empty(request))):
            return refused(failed)
        return JSONResponse(None)

    async def resume_memory(self, request: Request) -> Response:
        if failed := await self.resume_tags(_tags(await read_body_or_empty(request))):
            return refused(failed)
        return JSONResponse(None)

    async def release_tags(self, tags: tuple[str, ...]) -> str:
        """Every replica's device memory of `tags` released: "", or why not. New requests wait while
        the replicas answer (never reaching a worker that releases); they get a 503 only once some
        replica did release: a refusal (requests running) leaves nothing behind."""
        async with self.pipeline.gate.holding(f"{RELEASING}{self.pipeline.new_rid()}"):
            replies = await self.pipeline.control(lambda rid: protocol.Memory(rid, self.bus.name, True, tags), UPDATE_TIMEOUT_S,
                                                  DEVICE)
            if any(r.ok for r in replies):
                for tag in tags:
                    await self.bus.set_hold(RELEASED + tag)
        if failed := [r for r in replies if not r.ok]:
            return said(failed)
        return ""

    async def resume_tags(self, tags: tuple[str, ...]) -> str:
        """Every replica's memory of `tags` back: "", or why not. The weights' values are not (a
        replica awaits them from the next update, and refuses requests with a 503 until then)."""
        replies = await self.pipeline.control(lambda rid: protocol.Memory(rid, self.bus.name, False, tags), UPDATE_TIMEOUT_S, DEVICE)
        if failed := [r for r in replies if not r.ok]:
            return said(failed)
        for tag in tags:
            await self.bus.clear_hold(RELEASED + tag)
        return ""


async def read_body_or_empty(request: Request) -> dict:
    """Control routes take `{}`, no body at all, or a GET."""
    return await read_body(request, empty_ok=True)


def _commit_fields(body: dict) -> tuple[str | None, bool]:
    """(weight_version, flush_cache) of an update request, read before anything is staged."""
    return get(body, "weight_version", str, None), get(body, "flush_cache", bool, True)


def _tags(body: dict) -> tuple[str, ...]:
    tags = body.get("tags")
    if tags is None:
        return protocol.MEMORY_TAGS
    check(isinstance(tags, list) and bool(tags) and all(t in protocol.MEMORY_TAGS for t in tags), "tags",
          f"must be null (all) or a non-empty list of {list(protocol.MEMORY_TAGS)}")
    return tuple(dict.fromkeys(tags))


def said(replies) -> str:
    """The replicas' answers in one message, each naming its replica once (a scheduler's own refusal
    names it already; a worker's, relayed, does not)."""
    return "; ".join(r.message if r.message.startswith(f"replica {r.replica}") else f"replica {r.replica}: {r.message}"
                     for r in replies)


async def bounded_body(request: Request) -> bytes:
    """One bucket's bytes, the JSON or raw body, at most MAX_BUCKET_BYTES (not server.max_body_bytes:
    a bucket is tensors, not a request's fields)."""
    return await read_bounded(request, MAX_BUCKET_BYTES,
                              f"a bucket is over the limit of {MAX_BUCKET_BYTES} bytes: push the weights in smaller buckets",
                              request.app.state.limits.body_timeout_s)


def base64_buffers(value: object) -> list[bytes]:
    check(isinstance(value, list) and bool(value) and all(isinstance(v, str) and v for v in value), "serialized_named_tensors",
          "must be a non-empty list of base64 strings, each a safetensors buffer")
    try:
        return [base64.b64decode(v, validate=True) for v in value]
    except (binascii.Error, ValueError):
        raise invalid("'serialized_named_tensors' must hold base64 strings", "serialized_named_tensors") from None


def safetensors_bytes(data: bytes, param: str) -> bytes:
    """A bucket's bytes, once their header and layout read as safetensors: a malformed bucket is the
    client's 400 here, naming what is wrong (a tensor, mostly), before any worker reads it."""
    try:
        read_header(memoryview(data).cast("B"))
    except SafetensorsError as exc:
        raise invalid(f"'{param}' is not safetensors bytes: {exc}", param) from None
    return data


def query_fields(request: Request) -> dict:
    """The fields of a raw-bytes request, from its query: true/false, or a string."""
    fields: dict = {}
    for key, value in request.query_params.items():
        fields[key] = {"true": True, "false": False}.get(value.lower(), value) if key != "weight_version" else value
    return fields


