"""The gateway's HTTP app: routes (each in its key class, gateway/auth.py), error handling, health."""

from __future__ import annotations

import asyncio
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admin_routes import AdminRoutes
from gateway.auth import Guard
from gateway.collective_routes import CollectiveRoutes
from gateway.errors import ApiError, log_rejected
from gateway.generation import Pipeline
from gateway.lora_routes import LoraRoutes
from gateway.native_routes import NativeRoutes
from gateway.openai_routes import OpenAIRoutes
from gateway.openapi import document
from gateway.responses_routes import ResponseStore, ResponsesRoutes
from gateway.rl_routes import RLRoutes
from gateway.score_routes import ScoreRoutes
from gateway.tokens_routes import TokensRoutes
from gateway.vllm_rl_routes import VllmRLRoutes
from gateway.watchdog import PIPELINE, label, missing_roles, only_starting, starting_labels
from jaxstream.config import AppConfig
from jaxstream.heartbeat import as_json
from jaxstream.keys import Keys
from jaxstream.protocol import PROTOCOL_VERSION
from jaxstream.transport import TRANSIENT, Bus

log = logging.getLogger(__name__)

# Every role the pipeline needs; /health names the ones with no live instance.
ROLES = ("gateway", *PIPELINE)


class Health:
    def __init__(self, bus: Bus, reply_task: asyncio.Task, replicas: int, pipeline: Pipeline,
                 stall_limits: dict[str, float] | None = None) -> None:
        self.bus = bus
        self.reply_task = reply_task
        self.replicas = replicas
        self.pipeline = pipeline
        self.stall_limits = stall_limits or {}  # role -> s (ServerConfig.stall_limits)
        self.mismatch_logged: set[str] = set()  # instances whose protocol differs, said once in the log
        self.stall_logged: dict[str, str] = {}  # stalled instances as last logged: each stall said once

    def missing(self, live: list[str]) -> list[str]:
        """Every role with no live instance; with several replicas, each replica's scheduler and
        worker by name (`worker.1`)."""
        missing = missing_roles(live, self.replicas, ROLES)
        if self.reply_task.done() and "gateway" not in missing:
            missing.insert(0, "gateway")  # our own reply loop died
        return missing

    def mismatched(self, protocols: dict[str, int | None]) -> list[str]:
        """Each live instance that speaks another protocol than this gateway (their messages would
        not decode, or worse, decode as something else), named, and logged the first time seen."""
        found = []
        for name, version in sorted(protocols.items()):
            if version == PROTOCOL_VERSION:
                continue
            found.append(f"{name}: {'no protocol version' if version is None else f'protocol {version}'}, "
                         f"this gateway speaks {PROTOCOL_VERSION}")
            if name not in self.mismatch_logged:
                self.mismatch_logged.add(name)
                log.error("%s (every service must be of one build: /health answers 503 while it is not)", found[-1])
        return found

    def stalled(self, found: dict[str, str]) -> dict[str, str]:
        """Each live instance that holds work it does not do (jaxstream/transport/liveness.py), by
        health's label, saying why; logged as it starts."""
        for name, why in found.items():
            if name not in self.stall_logged:
                log.error("%s is stalled: %s", name, why)
        self.stall_logged = found
        return {label(name, self.replicas): why for name, why in found.items()}

    async def health(self, request: Request) -> Response:
        """200 when every role has a live instance, every instance speaks this gateway's protocol
        and none is stalled; else 503 naming the missing ones ("starting", with each one's phase,
        while every missing one is only starting), the mismatched and the stalled ones."""
        if self.pipeline.draining:  # a load balancer sends elsewhere while the requests in flight finish
            return JSONResponse({"status": "draining", "in_flight": self.pipeline.in_flight()}, status_code=503,
                                headers={"Retry-After": "1"})
        try:
            protocols = await self.bus.live_protocols()
            missing = self.missing(list(protocols))
            starting = starting_labels(await self.bus.starting(), self.replicas) if missing else {}
            stalled = self.stalled(await self.bus.stalls(self.replicas, self.stall_limits))
        except TRANSIENT as exc:
            return JSONResponse({"status": "unhealthy", "error": f"Redis unreachable: {exc}"}, status_code=503)
        mismatched = self.mismatched(protocols)
        if missing or mismatched or stalled:
            only = missing and not mismatched and not stalled and only_starting(missing, starting)
            phases = {m: starting[m] for m in missing if m in starting}
            body = {"status": "starting" if only else "unhealthy", "missing": missing, "starting": phases}
            body |= {"mismatched": mismatched} if mismatched else {}
            body |= {"stalled": stalled} if stalled else {}
            return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok"})

    async def stats(self, request: Request) -> Response:
        """Each live service instance's stats by role, e.g. the scheduler's running, waiting, pages."""
        await self.pipeline.write_stats()  # the schedulers' current
        stats = await self.bus.get_stats(ROLES)
        return JSONResponse({role: {name: as_json(s) for name, s in instances.items()} for role, instances in stats.items()})


async def openapi(request: Request) -> Response:
    """The OpenAPI document of the routes below (gateway/openapi.py), as FastAPI's servers, vLLM's
    and SGLang's, serve theirs."""
    return JSONResponse(request.app.state.openapi)


def build_app(bus: Bus, pipeline: Pipeline, cfg: AppConfig, reply_task: asyncio.Task, keys: Keys) -> Starlette:
    openai = OpenAIRoutes(pipeline, cfg.model.name, cfg.server.logprobs_mode, cfg.server, cfg.model.tool_parser,
                          cfg.model.reasoning_parser)
    responses = ResponsesRoutes(openai, ResponseStore(cfg.server.responses_store_size))
    native = NativeRoutes(pipeline, cfg.server.logprobs_mode, cfg.server, openai.adapters)
    admin_routes = AdminRoutes(pipeline, cfg)
    rl = RLRoutes(pipeline)
    lora = LoraRoutes(pipeline, openai.adapters)
    vllm_rl = VllmRLRoutes(rl, cfg)  # vLLM's dialect of the same control
    tokens = TokensRoutes(openai)
    collective = CollectiveRoutes(rl)
    scoring = ScoreRoutes(pipeline, cfg.model.name, openai.adapters)
    health = Health(bus, reply_task, cfg.parallelism.data, pipeline, cfg.server.stall_limits())
    guard = Guard(keys)
    user, admin, probe = guard.user, guard.admin, guard.probe  # each route's class (gateway/auth.py)
    routes = [
        Route("/v1/chat/completions", user(openai.chat), methods=["POST"]),
        Route("/v1/completions", user(openai.completions), methods=["POST"]),
        Route("/v1/responses", user(responses.create), methods=["POST"]),
        Route("/v1/responses/{response_id}", user(responses.stored), methods=["GET", "DELETE"]),
        Route("/v1/models", user(openai.models), methods=["GET"]),
        Route("/v1/models/{model:path}", user(openai.model), methods=["GET"]),
        Route("/generate", user(native.generate), methods=["POST", "PUT"]),
        Route("/v1/score", user(scoring.score), methods=["POST"]),
        Route("/health", probe(health.health), methods=["GET"]),
        Route("/health_generate", probe(admin_routes.health_generate), methods=["GET"]),
        Route("/stats", probe(health.stats), methods=["GET"]),
        Route("/metrics", probe(admin_routes.metrics), methods=["GET"]),
        Route("/openapi.json", probe(openapi), methods=["GET"]),
        Route("/version", user(admin_routes.version), methods=["GET"]),
        Route("/abort_request", admin(admin_routes.abort_request), methods=["POST"]),
        Route("/flush_cache", admin(admin_routes.flush_cache), methods=["GET", "POST"]),
        Route("/v1/loads", user(admin_routes.loads), methods=["GET"]),
        *[Route(path, user(admin_routes.model_info), methods=["GET"]) for path in ("/get_model_info", "/model_info")],
        *[Route(path, admin(admin_routes.server_info), methods=["GET"]) for path in ("/get_server_info", "/server_info")],
        *[Route(path, user(rl.weight_version), methods=["GET"]) for path in ("/get_weight_version", "/weight_version")],
        Route("/pause_generation", admin(rl.pause), methods=["POST"]),
        Route("/continue_generation", admin(rl.resume), methods=["POST"]),
        Route("/update_weights_from_disk", admin(rl.update_from_disk), methods=["POST"]),
        Route("/update_weights_from_tensor", admin(rl.update_from_tensor), methods=["POST"]),
        Route("/update_weight_version", admin(rl.update_version), methods=["POST"]),
        Route("/list_weights", admin(rl.list_weights), methods=["GET"]),
        Route("/v1/load_lora_adapter", admin(lora.vllm_load), methods=["POST"]),
        Route("/v1/unload_lora_adapter", admin(lora.vllm_unload), methods=["POST"]),
        Route("/load_lora_adapter", admin(lora.sglang_load), methods=["POST"]),
        Route("/unload_lora_adapter", admin(lora.sglang_unload), methods=["POST"]),
        Route("/load_lora_adapter_from_tensors", admin(lora.load_from_tensors), methods=["POST"]),
        Route("/release_memory_occupation", admin(rl.release_memory), methods=["GET", "POST"]),
        Route("/resume_memory_occupation", admin(rl.resume_memory), methods=["GET", "POST"]),
        Route("/inference/v1/generate", user(tokens.generate), methods=["POST"]),
        Route("/pause", admin(vllm_rl.pause), methods=["POST"]),
        Route("/resume", admin(vllm_rl.resume), methods=["POST"]),
        Route("/is_paused", user(vllm_rl.is_paused), methods=["GET"]),
        Route("/sleep", admin(vllm_rl.sleep), methods=["POST"]),
        Route("/wake_up", admin(vllm_rl.wake_up), methods=["POST"]),
        Route("/is_sleeping", user(vllm_rl.is_sleeping), methods=["GET"]),
        Route("/reset_prefix_cache", admin(vllm_rl.reset_prefix_cache), methods=["POST"]),
        Route("/get_world_size", admin(vllm_rl.get_world_size), methods=["GET"]),
        Route("/init_weights_update_group", admin(collective.init_group), methods=["POST"]),
        Route("/update_weights_from_distributed", admin(collective.update_from_distributed), methods=["POST"]),
        Route("/prepare_weights_update", admin(collective.prepare), methods=["POST"]),
        Route("/complete_weights_update", admin(collective.complete), methods=["POST"]),
        Route("/receive_weights", admin(collective.receive), methods=["POST"]),
        Route("/destroy_weights_update_group", admin(collective.destroy_group), methods=["POST"]),
        Route("/init_weight_transfer_engine", admin(collective.init_transfer_engine), methods=["POST"]),
        Route("/start_weight_update", admin(collective.start_update), methods=["POST"]),
        Route("/update_weights", admin(collective.update_weights), methods=["POST"]),
        Route("/finish_weight_update", admin(collective.finish_update), methods=["POST"]),
        *[Route(path, user(admin_routes.tokenize), methods=["POST"]) for path in ("/tokenize", "/v1/tokenize")],
        *[Route(path, user(admin_routes.detokenize), methods=["POST"]) for path in ("/detokenize", "/v1/detokenize")],
    ]

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        log_rejected(request, exc)
        return exc.response(request.url.path)

    async def http_error(request: Request, exc: Exception) -> Response:  # unknown route, wrong method
        assert isinstance(exc, HTTPException)
        error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        log_rejected(request, error)
        return error.response(request.url.path)

    async def internal_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, TRANSIENT):
            log.warning("Redis unreachable on %s: %s", request.url.path, exc)
            return ApiError(503, "the server's Redis is unreachable").response(request.url.path)
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return ApiError(500, f"internal error: {type(exc).__name__}").response(request.url.path)

    app = Starlette(routes=routes, exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: internal_error})
    app.state.limits = cfg.server  # what read_body bounds a body by (gateway/http.py)
    app.state.openapi = document(app.routes, keys)  # a route with no description fails here, at start-up
    return app
