"""vLLM's RL routes (its dev-mode routers: rlhf, sleep, cache), a second dialect over the machinery
of SGLang's (rl_routes.py): the same pause modes, memory release and prefix-cache flush, on every
replica. SkyRL and TRL drive a server through them.

- `/pause?mode=` (vLLM's PauseMode), each as one of ours: `abort` as `abort` (every request ends with
  its partial output, finish `abort`); `keep` as `in_place` (frozen with its KV, it goes on after
  /resume); `wait` holds new requests at the gateways while those in flight finish, then pauses as
  `retract` (nothing runs by then: a request that reached a replica meanwhile goes back to waiting,
  recomputed after /resume). `clear_cache` (vLLM's default true; not with keep) empties the prefix
  cache once paused. vLLM's deprecated `wait_for_inflight_requests=true` is `wait`.
- `/sleep?level=&mode=`: requests handled by `mode` as /pause's (`keep` as `retract` too: a sleep
  drops the KV cache, so a frozen request could not go on), then memory released: level 1 the KV
  cache alone, the weights staying on the device as they are (no host copy is kept here, and vLLM's
  level 1 promises the same weights after wake_up); level 2 the weights too, whose values are then
  awaited after /wake_up (push or load them), as after vLLM's level 2. Generation continues at
  once (unless a client had paused it before, or the release failed: then as it was); new requests
  get a 503 while memory is out (docs/rl.md).
- `/wake_up?tags=`: the tags named (`weights`, `kv_cache`; none: both) back.
- `/reset_prefix_cache`: empties every replica's prefix cache when no request runs; with
  `reset_running_requests` the running ones go back to waiting first (pause `retract`, flush,
  continue unless the server was paused already), as vLLM preempts them.

vLLM reads these fields from the query; SkyRL's older client sent them as a JSON body, which is read
when the query lacks them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import ApiError, invalid
from gateway.gate import PAUSED, RELEASED
from gateway.http import read_body
from gateway.params import check
from gateway.rl_routes import RLRoutes
from gateway.server_args import receiving_ranks
from jaxstream import protocol
from jaxstream.config import AppConfig

VLLM_PAUSE_MODES = ("abort", "wait", "keep")
OURS = {"abort": "abort", "wait": "retract", "keep": "in_place"}  # /pause's
SLEEP_LEVELS = {1: ("kv_cache",), 2: protocol.MEMORY_TAGS}  # what each level releases
DRAIN_POLL_S = 0.05
FLAGS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


class VllmRLRoutes:
    def __init__(self, rl: RLRoutes, cfg: AppConfig) -> None:
        self.rl = rl
        self.pipeline = rl.pipeline
        self.bus = rl.bus
        self.cfg = cfg

    # -- pause and resume

    async def pause(self, request: Request) -> Response:
        args = await arguments(request)
        mode = "wait" if flag(args, "wait_for_inflight_requests", False) else choice(args, "mode", VLLM_PAUSE_MODES, "abort")
        clear_cache = flag(args, "clear_cache", True) and mode != "keep"
        await self._pause(mode, OURS[mode])
        if clear_cache:
            busy = [r.message for r in await self.pipeline.flush_cache() if not r.flushed]
            if busy:
                raise invalid(f"paused, but the prefix cache was not emptied: {'; '.join(busy)}", "clear_cache")
        return JSONResponse({"status": "paused"})

    async def resume(self, request: Request) -> Response:
        await self.rl.continue_replicas()
        return JSONResponse({"status": "resumed"})

    async def is_paused(self, request: Request) -> Response:
        return JSONResponse({"is_paused": PAUSED in await self.bus.holds()})

    @asynccontextmanager
    async def _paused_for(self, vllm_mode: str, mode: str) -> AsyncIterator[None]:
        """The block runs with every replica paused (`_pause`); after it, however it ends (a pause
        refused included), the replicas continue, unless a client had paused them before."""
        before = PAUSED in await self.bus.holds()
        try:
            await self._pause(vllm_mode, mode)
            yield
        finally:
            if not before:
                await self.rl.continue_replicas()

    async def _pause(self, vllm_mode: str, mode: str) -> None:
        """Every replica paused in our `mode`; with vLLM's `wait`, once those in flight have finished."""
        if vllm_mode == "wait" and PAUSED not in await self.bus.holds():  # paused already, none could finish
            await self.bus.set_hold(PAUSED)  # first: no new request enters while the others finish
            await self._drained()
        if failed := await self.rl.pause_replicas(mode):
            raise ApiError(400, failed)

    async def _drained(self) -> None:
        """Returns once no replica runs or queues a request, as vLLM's wait mode (no time limit)."""
        while any(s.running or s.waiting for _, s in await self.pipeline.scheduler_stats()):
            await asyncio.sleep(DRAIN_POLL_S)

    # -- sleep and wake up

    async def sleep(self, request: Request) -> Response:
        args = await arguments(request)
        given = args.get("level", 1)  # an integer in a body, digits in a query
        level = int(given) if isinstance(given, str) and given.isdigit() else given
        check(type(level) is int and level in SLEEP_LEVELS, "level", f"must be 1 (the KV cache) or 2 (the weights too), got {json.dumps(args.get('level'))}")
        mode = choice(args, "mode", VLLM_PAUSE_MODES, "abort")
        # Once released, the memory's holds answer new requests 503; retracted ones wait for wake_up
        async with self._paused_for(mode, "abort" if mode == "abort" else "retract"):
            if failed := await self.rl.release_tags(SLEEP_LEVELS[level]):
                raise ApiError(400, failed)
        return JSONResponse({"status": "sleeping", "level": level})

    async def wake_up(self, request: Request) -> Response:
        args = await arguments(request)
        tags = args.get("tags") or None
        check(tags is None or isinstance(tags, list) and all(t in protocol.MEMORY_TAGS for t in tags), "tags",
              f"must name tags of {list(protocol.MEMORY_TAGS)} (none: all), got {json.dumps(tags)}")
        if failed := await self.rl.resume_tags(tuple(dict.fromkeys(tags or protocol.MEMORY_TAGS))):
            raise ApiError(400, failed)
        return JSONResponse({"status": "sleeping" if await self._sleeping() else "awake", "tags_woken": tags})

    async def is_sleeping(self, request: Request) -> Response:
        return JSONResponse({"is_sleeping": await self._sleeping()})

    async def _sleeping(self) -> bool:
        return any(reason.startswith(RELEASED) for reason in await self.bus.holds())

    # -- prefix cache, world size

    async def reset_prefix_cache(self, request: Request) -> Response:
        args = await arguments(request)
        reset_running = flag(args, "reset_running_requests", False)
        flag(args, "reset_external", False)  # checked; no cache lives outside the replicas here
        busy = [r.message for r in await self.pipeline.flush_cache() if not r.flushed]
        if busy and reset_running:
            async with self._paused_for("abort", "retract"):  # the running ones back to waiting, recomputed after
                busy = [r.message for r in await self.pipeline.flush_cache() if not r.flushed]
        if busy:
            raise invalid("the prefix cache was not reset: requests are running (reset_running_requests=true sends them "
                          f"back to waiting first, recomputed after). {'; '.join(busy)}", "reset_running_requests")
        return Response(status_code=200)

    async def get_world_size(self, request: Request) -> Response:
        """vLLM's, as its RL clients read it: the ranks a weight sync joins (one per replica), one
        replica's unless `include_dp` (server_args.receiving_ranks)."""
        include_dp = flag(await arguments(request), "include_dp", True)
        return JSONResponse({"world_size": receiving_ranks(self.cfg, include_dp)})


async def arguments(request: Request) -> dict:
    """The query's parameters (a repeated one, `tags`, as a list), over the JSON body's fields."""
    body = await read_body(request, empty_ok=True) if request.method != "GET" else {}
    query: dict = {key: request.query_params.get(key) for key in request.query_params}
    if "tags" in query:
        query["tags"] = request.query_params.getlist("tags")
    return {**body, **query}


def flag(args: dict, name: str, default: bool) -> bool:
    """A boolean from the query ("true", "false", as FastAPI reads them) or the body."""
    value = args.get(name)
    if value is None:
        return default
    if isinstance(value, str):
        value = FLAGS.get(value.lower(), value)
    check(isinstance(value, bool), name, f"must be true or false, got {json.dumps(value)}")
    return value


def choice(args: dict, name: str, choices: tuple[str, ...], default: str) -> str:
    value = args.get(name)
    if value is None:
        return default
    check(value in choices, name, f"must be one of {', '.join(choices)}; got {json.dumps(value)}")
    return value
