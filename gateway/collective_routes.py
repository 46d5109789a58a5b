"""Collective weight sync over HTTP (docs/rl.md): every replica's worker joins the trainer's
torch.distributed group as one receiving rank, and the tensors the trainer broadcasts in it are
staged, then swapped in, as any weight update is (gateway/rl_routes.py: every replica stages, one
refusal drops every replica's staging, then every replica commits). Two dialects on that one path.

SGLang's, with xorl-sglang's two-phase form:
- /init_weights_update_group: master_address, master_port, rank_offset, world_size, group_name, backend
- /update_weights_from_distributed: names, dtypes, shapes (or the older name, dtype, shape),
  group_name, flush_cache, weight_version, load_format (null; "flattened_bucket": the bucket's bytes
  in one uint8 broadcast), abort_all_requests: one bucket received, then swapped in
- /prepare_weights_update (the same tensor fields, or `buckets` of them): answered at once while
  the receive goes on; /complete_weights_update (group_name, flush_cache, weight_version) waits for
  it, then swaps in everything staged
- /receive_weights: one bucket received and staged, not swapped (that is /complete_weights_update's)
- /destroy_weights_update_group: group_name
vLLM's weight-transfer handshake (the group is VLLM_GROUP):
- /init_weight_transfer_engine: init_info {master_address, master_port, rank_offset, world_size}
- /start_weight_update (drops any staging), /update_weights (update_info: names, dtype_names,
  shapes, packed, packed_buffer_size_bytes), /finish_weight_update (weight_version): the swap

Ranks: replica r's worker is rank rank_offset + r, one rank per replica (a replica of several
devices is one process: vLLM's rank_offset + dp_rank * ranks per replica, with one). So the world
holds the trainer's ranks and `dp_size` ranks of this server: rank_offset + dp_size <= world_size.
"""

from __future__ import annotations

import asyncio
import json
import math
from functools import partial

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import ApiError, invalid
from gateway.http import read_body
from gateway.params import check, get, one_of
from gateway.rl_routes import DEVICE, UPDATE_TIMEOUT_S, RLRoutes, read_body_or_empty, refused, said, sglang_failures
from jaxstream import protocol
from jaxstream.english import counted

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
VLLM_GROUP = "weight_transfer_engine"  # vLLM's handshake names no group: its one group is this
LOAD_FORMATS = {None: 0, "flattened_bucket": protocol.PACKED_WHOLE}  # /update_weights_from_distributed's, as Broadcast.packing
VLLM_BUFFER_BYTES = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES


class CollectiveRoutes:
    def __init__(self, rl: RLRoutes) -> None:
        self.rl = rl
        self.pipeline = rl.pipeline
        self.bus = rl.bus
        self.receiving: dict[str, list[asyncio.Task]] = {}  # by group: receives /prepare_weights_update started
        self.largest: int | None = None  # elements of the largest tensor the model reads

    # -- SGLang's

    @sglang_failures
    async def init_group(self, request: Request) -> Response:
        body = await read_body(request)
        group = group_name(body)
        backend = get(body, "backend", str, "nccl")
        check(backend in protocol.GROUP_BACKENDS, "backend", one_of(protocol.GROUP_BACKENDS, backend))
        replies = await self._join(group, join_fields(body, self.pipeline.replicas.count), backend)
        return JSONResponse({"success": True, "message": said(replies)})

    @sglang_failures
    async def update_from_distributed(self, request: Request) -> Response:
        body = await read_body(request)
        broadcast = await self._broadcast(body, group_name(body), load_format(body))
        version, flush = commit_fields(body)
        abort = get(body, "abort_all_requests", bool, False)
        async with self.rl.updating:
            if abort:
                await self.pipeline.abort_all("aborted by a weight update (abort_all_requests)")
            if failure := await self._stage(broadcast):
                return failure
            return await self.rl._commit(version, flush, f"{counted(len(broadcast.names), 'tensor')} received in group {broadcast.group!r}")

    @sglang_failures
    async def prepare(self, request: Request) -> Response:
        """Start receiving, answer at once: the trainer broadcasts once it has the answer."""
        body = await read_body(request)
        group, packing = group_name(body), load_format(body)
        transport = get(body, "transport", str, "nccl_broadcast")
        check(transport == "nccl_broadcast", "transport", f"must be 'nccl_broadcast' (a torch.distributed broadcast), got {transport!r}")
        if "buckets" in body:
            buckets = get(body, "buckets", list)
            check(bool(buckets) and all(isinstance(b, dict) for b in buckets), "buckets", "must be a non-empty list of objects")
            broadcasts = [await self._broadcast(b, group, packing, prefix=f"buckets[{i}].") for i, b in enumerate(buckets)]
        else:
            broadcasts = [await self._broadcast(body, group, packing)]
        task = asyncio.create_task(self._receive(broadcasts))
        task.add_done_callback(_retrieved)
        self.receiving.setdefault(group, []).append(task)
        tensors = counted(sum(len(b.names) for b in broadcasts), "tensor")
        return JSONResponse({"success": True, "status": "ready",
                             "message": f"receiving {tensors} in group {group!r}: broadcast them, then /complete_weights_update"})

    @sglang_failures
    async def complete(self, request: Request) -> Response:
        """Wait for the receives /prepare_weights_update started, then swap in everything staged."""
        body = await read_body(request)
        group = group_name(body)
        version, flush = commit_fields(body)
        failure = None
        for task in self.receiving.pop(group, []):
            result = await task
            failure = failure or result
        async with self.rl.updating:
            if failure is not None:  # a receive after the refused one may have staged again: drop that too
                await self._discard()
                return failure
            return await self.rl._commit(version, flush, f"weights received in group {group!r}")

    @sglang_failures
    async def receive(self, request: Request) -> Response:
        """One bucket received and staged; the swap waits for /complete_weights_update."""
        body = await read_body(request)
        broadcast = await self._broadcast(body, group_name(body), load_format(body))
        async with self.rl.updating:
            if failure := await self._stage(broadcast):
                return failure
        return JSONResponse({"success": True, "message": f"{counted(len(broadcast.names), 'tensor')} received and staged: "
                                                         "/complete_weights_update swaps them in"})

    @sglang_failures
    async def destroy_group(self, request: Request) -> Response:
        group = group_name(await read_body_or_empty(request))
        self.receiving.pop(group, None)  # a receive still going fails with the group, unawaited
        replies = await self.pipeline.control(lambda rid: protocol.WeightGroup(rid, self.bus.name, group, False), UPDATE_TIMEOUT_S, DEVICE)
        if failed := [r for r in replies if not r.ok]:
            return refused(said(failed))
        return JSONResponse({"success": True, "message": said(replies)})

    # -- vLLM's

    @sglang_failures
    async def init_transfer_engine(self, request: Request) -> Response:
        info = get(await read_body(request), "init_info", dict)
        check(info is not None, "init_info", "must be an object: master_address, master_port, rank_offset, world_size")
        backend = get(info, "backend", str, "", prefix="init_info.")  # ours: "" lets the workers' devices choose
        check(backend in ("", *protocol.GROUP_BACKENDS), "init_info.backend", one_of(protocol.GROUP_BACKENDS, backend))
        replies = await self._join(VLLM_GROUP, join_fields(info, self.pipeline.replicas.count, "init_info."), backend)
        return JSONResponse({"message": "Weight transfer initialized", "detail": said(replies)})

    @sglang_failures
    async def start_update(self, request: Request) -> Response:
        body = await read_body_or_empty(request)
        check(get(body, "is_checkpoint_format", bool, True), "is_checkpoint_format",
              "must be true: the tensors come by Hugging Face name and layout (a checkpoint's)")
        async with self.rl.updating:
            await self._discard()  # what an update that never finished left staged
        return JSONResponse({"message": "Weight update started"})

    @sglang_failures
    async def update_weights(self, request: Request) -> Response:
        info = get(await read_body(request), "update_info", dict)
        check(info is not None, "update_info", "must be an object: names, dtype_names, shapes, packed")
        prefix = "update_info."
        check(get(info, "is_checkpoint_format", bool, True, prefix=prefix), prefix + "is_checkpoint_format",
              "must be true: the tensors come by Hugging Face name and layout (a checkpoint's)")
        packing = 0
        if get(info, "packed", bool, False, prefix=prefix):
            packing = get(info, "packed_buffer_size_bytes", int, VLLM_BUFFER_BYTES, prefix=prefix)
            check(packing > 0, prefix + "packed_buffer_size_bytes", f"must be positive, got {packing}")
        broadcast = await self._broadcast(info, VLLM_GROUP, packing, prefix=prefix, dtypes="dtype_names", singular=False)
        async with self.rl.updating:
            if failure := await self._stage(broadcast):
                return failure
        return JSONResponse({"message": "Weights updated"})

    @sglang_failures
    async def finish_update(self, request: Request) -> Response:
        version = get(await read_body_or_empty(request), "weight_version", str, None)
        async with self.rl.updating:
            response = await self.rl._commit(version, True, "weights received by vLLM's weight transfer")
        if response.status_code != 200:
            return response
        return JSONResponse({**json.loads(response.body), "message": "Weight update finished"})

    # -- the machinery

    async def _join(self, group: str, fields: dict, backend: str) -> list[protocol.ControlReply]:
        """Every replica's worker joins, or none stays: ApiError (a refusal) naming the replicas that
        could not, after the others left."""
        replies = await self.pipeline.control(lambda rid: protocol.WeightGroup(rid, self.bus.name, group, True, backend=backend, **fields),
                                              UPDATE_TIMEOUT_S, DEVICE)
        if failed := [r for r in replies if not r.ok]:
            if len(failed) < len(replies):
                await self.pipeline.control(lambda rid: protocol.WeightGroup(rid, self.bus.name, group, False), UPDATE_TIMEOUT_S, DEVICE)
            raise invalid(said(failed))
        return replies

    async def _broadcast(self, body: dict, group: str, packing: int, *, prefix: str = "", dtypes: str = "dtypes",
                         singular: bool = True) -> protocol.Broadcast:
        """The tensors a request says the trainer broadcasts, checked: names, dtypes and shapes."""
        one = singular and "names" not in body and "name" in body  # SGLang's older form: one tensor
        if one:
            names, kinds, shapes = [get(body, "name", str)], [get(body, "dtype", str)], [get(body, "shape", list)]
        else:
            names, kinds, shapes = (get(body, key, list, prefix=prefix) for key in ("names", dtypes, "shapes"))

        def field(key: str, i: int) -> str:
            return {"names": "name", "dtypes": "dtype", "shapes": "shape"}[key] if one else f"{prefix}{key}[{i}]"

        check(bool(names) and all(isinstance(n, str) and n for n in names), "name" if one else prefix + "names",
              "must be a non-empty list of tensor names")
        for key, values in ((dtypes, kinds), ("shapes", shapes)):
            check(isinstance(values, list) and len(values) == len(names), prefix + key, f"must give one per name ({len(names)})")
        largest = await self._largest()
        for i, (kind, shape) in enumerate(zip(kinds, shapes)):
            kinds[i] = kind.removeprefix("torch.") if isinstance(kind, str) else kind
            check(kinds[i] in protocol.WIRE_DTYPES, field(dtypes, i), one_of(tuple(protocol.WIRE_DTYPES), kind))
            check(isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape), field("shapes", i),
                  "must be a list of non-negative integers")
            check(math.prod(shape) <= largest, field("shapes", i),
                  f"has {math.prod(shape)} elements, more than the largest tensor the model reads ({largest})")
        return protocol.Broadcast(group, tuple(names), tuple(kinds), tuple(tuple(s) for s in shapes), packing)

    async def _stage(self, broadcast: protocol.Broadcast) -> Response | None:
        return await self.rl._stage(partial(protocol.UpdateWeights, gateway=self.bus.name, phase="stage", broadcast=broadcast))

    async def _receive(self, broadcasts: list[protocol.Broadcast]) -> Response | None:
        """Each in turn, all received even after a refusal (the trainer broadcasts them all); the
        first refusal, with every staging dropped."""
        failure = None
        async with self.rl.updating:
            for broadcast in broadcasts:
                failure = await self._stage(broadcast) or failure
            if failure is not None:
                await self._discard()
        return failure

    async def _discard(self) -> None:
        await self.pipeline.control(lambda rid: protocol.UpdateWeights(rid, self.bus.name, "discard"), UPDATE_TIMEOUT_S, DEVICE)

    async def _largest(self) -> int:
        """Elements of the largest tensor the model reads (the workers publish their names): what a
        declared shape may not pass, so no worker allocates a buffer nothing could fill."""
        if self.largest is None:
            raw = await self.bus.get_value(self.bus.keys.weight_names)
            if raw is None:
                raise ApiError(503, "no worker has published its weights' names yet")
            self.largest = max((math.prod(shape) for _, shape, _ in json.loads(raw)), default=1)
        return self.largest


def group_name(body: dict) -> str:
    group = get(body, "group_name", str, DEFAULT_GROUP)
    check(bool(group), "group_name", "must be a non-empty string")
    return group


def join_fields(body: dict, replicas: int, prefix: str = "") -> dict:
    """A join's rendezvous and ranks, checked: this server's ranks must fit in the world."""
    address = get(body, "master_address", str, prefix=prefix)
    check(bool(address), prefix + "master_address", "must name the host where the trainer's rank 0 listens")
    port = get(body, "master_port", int, prefix=prefix)
    check(port is not None and 1 <= port <= 65535, prefix + "master_port", f"must be a port, 1 to 65535, got {port}")
    offset = get(body, "rank_offset", int, prefix=prefix)
    check(offset is not None and offset >= 1, prefix + "rank_offset", "must be at least 1: rank 0 is the trainer's, which broadcasts")
    world = get(body, "world_size", int, prefix=prefix)
    check(world is not None and world >= offset + replicas, prefix + "world_size",
          f"must hold this server's {counted(replicas, 'rank')} (one per data-parallel replica) from rank_offset {offset}: "
          f"at least {offset + replicas}, got {world}")
    return {"master_address": address, "master_port": port, "rank_offset": offset, "world_size": world}


def load_format(body: dict) -> int:
    value = get(body, "load_format", str, None)
    check(value in LOAD_FORMATS, "load_format", "must be null (a broadcast per tensor) or 'flattened_bucket' (one for the "
                                                f"bucket), got {value!r}")
    return LOAD_FORMATS[value]


def commit_fields(body: dict) -> tuple[str | None, bool]:
    """(weight_version, flush_cache) of the request that swaps the weights in."""
    return get(body, "weight_version", str, None), get(body, "flush_cache", bool, True)


def _retrieved(task: asyncio.Task) -> None:
    """A receive nobody awaits any more (its group destroyed): its error is in the workers' logs."""
    if not task.cancelled():
        task.exception()
