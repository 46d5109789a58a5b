"""LoRA adapters loaded and unloaded at run time, in vLLM's and SGLang's dialects, and pushed by a
trainer (docs/api.md, LoRA adapters; docs/rl.md).

1. A load asks every replica (gateway -> scheduler -> worker in step order, as every control
   message): the scheduler picks a slot no request reads (scheduler_svc/adapters.py), the worker reads
   and checks the adapter (a PEFT directory on its disk, or the pushed tensors) and writes that slot
   between steps, so no request sees half an adapter and nothing recompiles. One refusal unloads it
   from the replicas that took it (a new name; a reload keeps what each replica has) and answers 400
   naming what did not fit. Then the name goes into the Redis hash every gateway reads
   (gateway/adapters.py).
2. An unload takes the name off every replica's registry at once (new requests naming it get a 404);
   requests running under it finish under it, and its slot is freed when they end.
3. A push (/load_lora_adapter_from_tensors) is SGLang's route with safetensors instead of pickles:
   each bucket's bytes wait in Redis (the gateway's `pushing`: the buckets of one push go through one
   gateway) until the last bucket, which loads them all into the named adapter (created on the first
   push, replaced after) with its LoRA config, and sets `weight_version` as a full update does.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from gateway.adapters import Adapters
from gateway.body import parse_json
from gateway.errors import ApiError, log_rejected
from gateway.generation import Pipeline
from gateway.http import read_body
from gateway.params import check, get
from gateway.rl_routes import (
    BLOB_PART_BYTES, BLOB_TTL_S, DEVICE, UPDATE_TIMEOUT_S, base64_buffers, bounded_body, query_fields, safetensors_bytes, said,
)
from jaxstream import protocol

CONFIG_FIELDS = ("r", "lora_alpha", "target_modules", "use_rslora")  # of PEFT's LoraConfig, what a push brings


class LoraRoutes:
    def __init__(self, pipeline: Pipeline, adapters: Adapters) -> None:
        self.pipeline = pipeline
        self.bus = pipeline.bus
        self.adapters = adapters
        self.loading = asyncio.Lock()  # one load or unload at a time through this gateway
        self.pushing: dict[str, list[tuple[str, ...]]] = {}  # adapter -> the Redis keys of its buckets so far

    # -- vLLM's: a plain-text success, OpenAI-shaped errors

    async def vllm_load(self, request: Request) -> Response:
        body = await read_body(request)
        name, path = get(body, "lora_name", str, ""), get(body, "lora_path", str, "")
        if not name or not path:  # vLLM's words (serving_models.py, _check_load_lora_adapter_request)
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.", "lora_name" if not name else "lora_path")
        await self.load(name, path=path, replace=get(body, "load_inplace", bool, False))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def vllm_unload(self, request: Request) -> Response:
        body = await read_body(request)
        name = get(body, "lora_name", str, "")
        check(bool(name), "lora_name", "must name the adapter to unload")
        await self.unload(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    # -- SGLang's: LoRAUpdateOutput (success, error_message, loaded_adapters)

    async def sglang_load(self, request: Request) -> Response:
        async def load() -> None:
            body = await read_body(request)
            name, path = get(body, "lora_name", str, ""), get(body, "lora_path", str, "")
            check(bool(name), "lora_name", "must name the adapter")
            check(bool(path), "lora_path", "must be the adapter's PEFT directory on the workers' machine")
            await self.load(name, path=path)
        return await self._sglang(request, load)

    async def sglang_unload(self, request: Request) -> Response:
        async def unload() -> None:
            name = get(await read_body(request), "lora_name", str, "")
            check(bool(name), "lora_name", "must name the adapter to unload")
            await self.unload(name)
        return await self._sglang(request, unload)

    async def load_from_tensors(self, request: Request) -> Response:
        """One bucket of an adapter's tensors by PEFT's names, as safetensors bytes: the raw body with
        the fields in the query (lora_name, r, lora_alpha, target_modules comma-separated, use_rslora,
        last_bucket, weight_version), or JSON with `serialized_named_tensors` (base64 buffers) and
        SGLang's `config_dict`. The adapter is loaded with the last bucket (`last_bucket`, default true)."""
        async def push() -> str:
            if request.headers.get("content-type", "").startswith("application/json"):
                body = parse_json(await bounded_body(request), request.app.state.limits.max_json_depth)
                buffers = [safetensors_bytes(b, "serialized_named_tensors") for b in base64_buffers(body.get("serialized_named_tensors"))]
                config = get(body, "config_dict", dict, {})
                check(get(body, "load_format", str, None) in (None, "safetensors"), "load_format",
                      "must be 'safetensors' (or absent): the tensors are safetensors bytes, never pickles")
            else:
                body = query_fields(request)
                buffers = [safetensors_bytes(await bounded_body(request), "body")]
                config = {k: body[k] for k in CONFIG_FIELDS if k in body}
                if isinstance(config.get("target_modules"), str):
                    config["target_modules"] = [m for m in config["target_modules"].split(",") if m]
            name = get(body, "lora_name", str, "")
            check(bool(name), "lora_name", "must name the adapter to push into")
            rank, alpha, modules, rslora = _lora_config(config)
            version = get(body, "weight_version", str, None)
            keys = self.pushing.setdefault(name, [])
            for data in buffers:
                keys.append(await self.bus.put_blob(f"{self.pipeline.new_rid()}:lora", data, BLOB_PART_BYTES, BLOB_TTL_S))
            if not get(body, "last_bucket", bool, True):
                return "bucket staged; the adapter loads with the last bucket"
            parts = tuple(self.pushing.pop(name))
            try:
                await self.load(name, blobs=parts, rank=rank, alpha=alpha, target_modules=modules, use_rslora=rslora,
                                version=version, replace=True)
            finally:
                for key in parts:
                    await self.bus.delete_keys(key)
            return f"adapter {name!r} loaded; weight version {self.pipeline.version_seen!r}"
        return await self._sglang(request, push)

    # -- both dialects

    async def load(self, name: str, *, path: str = "", replace: bool = False, version: str | None = None, **tensors) -> None:
        """`name` loaded on every replica (the module's 1.), or ApiError naming why not."""
        check(name not in (self.adapters.model_name, "default"), "lora_name", f"{name!r} is the base model's name")
        async with self.loading:
            if not replace and name in await self.adapters.loaded():  # vLLM's words
                raise ApiError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
            replies = await self.pipeline.control(
                lambda rid: protocol.LoadAdapter(rid, self.bus.name, name, path, version=version, **tensors), UPDATE_TIMEOUT_S, DEVICE)
            if failed := [r for r in replies if not r.ok]:
                if not replace and len(failed) < len(replies):  # all or none: off the replicas that took it
                    await self.pipeline.control(lambda rid: protocol.UnloadAdapter(rid, self.bus.name, name), UPDATE_TIMEOUT_S)
                raise ApiError(400, said(failed), "lora_path" if path else "lora_name")
            await self.bus.put_adapter(name, path)
            if version is not None:
                self.pipeline.version_seen = replies[0].weight_version

    async def unload(self, name: str) -> None:
        async with self.loading:
            if name not in await self.adapters.loaded():  # vLLM's words
                raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
            replies = await self.pipeline.control(lambda rid: protocol.UnloadAdapter(rid, self.bus.name, name), UPDATE_TIMEOUT_S)
            await self.bus.delete_adapter(name)  # a replica that did not know it (a restarted worker's) has it no more either
            if failed := [r for r in replies if not r.ok]:
                raise ApiError(400, said(failed), "lora_name")

    async def _sglang(self, request: Request, action) -> Response:
        """SGLang's LoRAUpdateOutput, with OpenAI's error object beside its error_message on a refusal."""
        try:
            message = await action()
        except ApiError as exc:
            if exc.status in (408, 499):  # the body never came whole: the app's answer, which closes the connection
                raise
            log_rejected(request, exc)
            return JSONResponse({"success": False, "error_message": exc.message, "loaded_adapters": await self.adapters.loaded(),
                                 **exc.body()}, status_code=exc.status)
        reply = {"success": True, "error_message": None, "loaded_adapters": await self.adapters.loaded()}
        return JSONResponse(reply | ({"message": message} if message else {}))


def _lora_config(config: dict) -> tuple[int, float, tuple[str, ...], bool]:
    """(r, lora_alpha, target_modules, use_rslora) of a push's LoRA config, each checked by name."""
    rank, alpha, modules, rslora = (config.get(k) for k in CONFIG_FIELDS)
    if isinstance(rank, str) and rank.isdigit():  # from the query
        rank = int(rank)
    check(isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1, "r", "must be the adapter's rank, a positive integer")
    try:
        alpha = float(8 if alpha is None else alpha)  # PEFT's default lora_alpha, as a directory's config reads
    except (TypeError, ValueError):
        raise ApiError(400, "'lora_alpha' must be a number", "lora_alpha") from None
    check(isinstance(modules, list) and bool(modules) and all(isinstance(m, str) for m in modules), "target_modules",
          "must name the adapted modules (PEFT's names: q_proj, v_proj, ...)")
    if isinstance(rslora, str):
        rslora = rslora.lower() == "true"
    return rank, alpha, tuple(modules), bool(rslora)
