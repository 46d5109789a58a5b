"""Operations routes, in SGLang's and vLLM's spellings: health by generation, model and server
info, aborts, prefix cache flush, weight version, load, (de)tokenization and Prometheus metrics."""

from __future__ import annotations

import asyncio
import json
import platform
import time
from importlib.metadata import version

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import ApiError, invalid
from gateway.fields import ABORT_ALL, ABORT_RID, ADD_SPECIAL_TOKENS, RETURN_TOKEN_STRS, SKIP_SPECIAL_TOKENS
from gateway.generation import Pipeline
from gateway.http import read_body
from gateway.messages import chat_messages, template_kwargs
from gateway.params import ID_RANGE, chat_continuation, check, is_token_id, read
from gateway.scheduler_metrics import kv_usage, prefix_hit_rate
from gateway.server_args import sglang_args, vllm_config
from gateway.tools import tool_use
from jaxstream import protocol
from jaxstream.config import AppConfig
from jaxstream.heartbeat import as_json
from jaxstream.keys import public_config

MAX_FLUSH_WAIT_S = 600.0
FLUSH_RETRY_S = 0.1


class AdminRoutes:
    def __init__(self, pipeline: Pipeline, cfg: AppConfig) -> None:
        self.pipeline = pipeline
        self.cfg = cfg
        self.started = time.time()

    async def health_generate(self, request: Request) -> Response:
        """Healthy when a one-token generation comes back in time; aborted if it does not."""
        sampling = protocol.SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        outputs = self.pipeline.stream(f"health-{self.pipeline.new_rid()}", sampling, input_ids=(0,))

        async def one_token() -> None:
            async for out in outputs:
                if out.finish is not None:
                    return

        timeout = self.cfg.server.health_generate_timeout_s
        try:
            await asyncio.wait_for(one_token(), timeout)
        except TimeoutError:
            raise ApiError(503, f"no token generated within {timeout:g} s") from None
        finally:
            await outputs.aclose()  # aborts it if it is still running
        return Response(status_code=200)

    async def model_info(self, request: Request) -> Response:
        served = await self.pipeline.model_facts()
        facts = served.facts  # None while no worker has reported; the fake worker's name no architecture (null)
        return JSONResponse({
            "model_path": served.model_path or self.cfg.model.path,  # the last checkpoint loaded
            "tokenizer_path": self.cfg.model.tokenizer or self.cfg.model.path,
            "served_model_name": self.cfg.model.name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": served.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": (facts.model_type or None) if facts else None,
            "architectures": facts.architectures.split(",") if facts and facts.architectures else None,
            "max_model_len": served.max_model_len,
            "vocab_size": served.tokenizer.vocab_size if served.tokenizer else None,
        })

    async def server_info(self, request: Request) -> Response:
        """SGLang's server info (its ServerArgs' names, gateway/server_args.py) and, in the same answer,
        vLLM's (`vllm_config`, `vllm_env`, `system_env`): `?config_format=text` gives `vllm_config`
        as JSON text, as vLLM's text format is a string; json (the default here) an object."""
        config_format = request.query_params.get("config_format", "json")
        if config_format not in ("json", "text"):
            raise invalid(f"'config_format' must be \"json\" or \"text\", got {json.dumps(config_format)}", "config_format")
        cfg = self.cfg
        served = await self.pipeline.model_facts()
        schedulers = await self.pipeline.scheduler_stats()
        model_path, context = served.model_path or cfg.model.path, served.max_model_len
        vllm = vllm_config(cfg, model_path, context)
        sglang = sglang_args(cfg, model_path, context, served.weight_version)
        if schedulers:  # their own word: a hybrid with no state snapshots has no prefix cache (scheduler.state_snapshots)
            cached = any(s.prefix_cache for _, s in schedulers)
            sglang["disable_radix_cache"], vllm["cache_config"]["enable_prefix_caching"] = not cached, cached
        per_token = served.worker.kv_bytes_per_token if served.worker else None  # UNSET: the fake worker's
        return JSONResponse({
            **sglang,
            # the workers' own word (their heartbeat facts), which decides whether a request gets them
            "enable_return_routed_experts": bool(served.facts and served.facts.enable_return_routed_experts),
            # the KV cache's bytes per token as a worker allocated it (null: none reported, or the fake worker)
            "kv_bytes_per_token": per_token if isinstance(per_token, int) else None,
            "version": version("jaxstream"),
            "startup_time": self.started,
            "internal_states": [{"replica": replica, **as_json(s)} for replica, s in schedulers],  # one per live scheduler
            "config": public_config(cfg),  # the Redis password masked; keys are never in the config
            "vllm_config": vllm if config_format == "json" else json.dumps(vllm),
            "vllm_env": {},  # no VLLM_* variable means anything here
            "system_env": {"platform": platform.platform(), "python": platform.python_version()},
        })

    async def version(self, request: Request) -> Response:
        """vLLM's and SGLang's `/version`: the server's package version."""
        return JSONResponse({"version": version("jaxstream")})

    async def flush_cache(self, request: Request) -> Response:
        """SGLang's /flush_cache: empty every replica's prefix cache, only when no request runs or
        waits there (it never aborts one): 200, else 400 naming what runs. `?timeout=s` keeps
        trying that long for the server to go idle (SGLang's; default 0: try once)."""
        try:
            timeout = float(request.query_params.get("timeout", 0))
        except ValueError:
            timeout = -1.0
        if not 0 <= timeout <= MAX_FLUSH_WAIT_S:
            raise invalid(f"'timeout' must be a number of seconds in [0, {MAX_FLUSH_WAIT_S:g}]", "timeout")
        deadline = time.monotonic() + timeout
        while True:
            replies = await self.pipeline.flush_cache()
            busy = [r.message for r in replies if not r.flushed]
            if not busy:
                return Response("Cache flushed.\n", media_type="text/plain")
            if time.monotonic() >= deadline:
                raise invalid("Cache not flushed: requests are running or waiting, and flushing never aborts them "
                              f"(wait for them, or /abort_request first). {'; '.join(busy)}")
            await asyncio.sleep(FLUSH_RETRY_S)

    async def abort_request(self, request: Request) -> Response:
        """`{"rid": ...}` or `{"abort_all": true}`. Aborted requests still answer, with their partial
        tokens and logprobs and finish type `abort`."""
        body = await read_body(request)
        if read(body, ABORT_ALL):
            await self.pipeline.abort_all("aborted by /abort_request")
            return Response(status_code=200)
        rid = read(body, ABORT_RID)
        check(bool(rid), "rid", "must name a request (or pass 'abort_all': true)")
        self.pipeline.abort(rid, "aborted by /abort_request")
        return Response(status_code=200)

    async def loads(self, request: Request) -> Response:
        """SGLang's `/v1/loads` (core fields): one entry per live scheduler, `dp_rank` its replica."""
        loads = []
        for rank, s in await self.pipeline.scheduler_stats():
            total = s.max_total_tokens
            used = round(kv_usage([s]) * total)  # cached pages nobody reads count as free
            loads.append({"dp_rank": rank, "num_running_reqs": s.running, "num_waiting_reqs": s.waiting,
                          "num_used_tokens": used, "max_total_num_tokens": total, "token_usage": used / total if total else 0.0,
                          "max_running_requests": s.max_running_requests, "cache_hit_rate": prefix_hit_rate([s])})
        return JSONResponse({"timestamp": time.time(), "version": version("jaxstream"), "loads": loads})

    async def metrics(self, request: Request) -> Response:
        body = self.pipeline.metrics.render(await self.pipeline.scheduler_stats())
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> Response:
        """SGLang's and vLLM's request forms; the answer has both engines' keys."""
        body = await read_body(request)
        add_special = read(body, ADD_SPECIAL_TOKENS)
        strs = read(body, RETURN_TOKEN_STRS)
        if "messages" in body:
            messages = chat_messages(body)
            reply = await self.pipeline.tokenize(messages=messages, add_special_tokens=bool(add_special),  # the template holds its own
                                               **chat_continuation(body, messages), token_strs=strs,
                                               tools=tool_use(body).rendered(),  # the prompt chat would run
                                               chat_template_kwargs=template_kwargs(body))
            return JSONResponse(self._tokens([reply], strs, batch=False))
        prompt = body.get("prompt")
        batch = isinstance(prompt, list)
        texts = prompt if batch else [prompt]
        check(bool(texts) and all(isinstance(t, str) for t in texts), "prompt", "must be a string or a list of strings (or pass 'messages')")
        replies = await asyncio.gather(*(self.pipeline.tokenize(text=t, add_special_tokens=add_special is not False, token_strs=strs)
                                         for t in texts))
        return JSONResponse(self._tokens(list(replies), strs, batch))

    @staticmethod
    def _tokens(replies: list[protocol.TokenizeReply], strs: bool, batch: bool) -> dict:
        tokens = [list(r.token_ids) for r in replies]
        out = {"tokens": tokens if batch else tokens[0], "count": [len(t) for t in tokens] if batch else len(tokens[0]),
               "max_model_len": replies[0].max_model_len}
        token_strs = [list(r.token_strs or ()) for r in replies]
        out["token_strs"] = (token_strs if batch else token_strs[0]) if strs else None  # always there, as vLLM's
        return out

    async def detokenize(self, request: Request) -> Response:
        body = await read_body(request)
        tokens = body.get("tokens")
        batch = isinstance(tokens, list) and bool(tokens) and all(isinstance(t, list) for t in tokens)
        lists = tokens if batch else [tokens]
        for ids in lists:
            if not (isinstance(ids, list) and all(map(is_token_id, ids))):
                raise invalid(f"'tokens' must be a list of token ids ({ID_RANGE}) or a list of such lists", "tokens")
        skip = read(body, SKIP_SPECIAL_TOKENS)
        texts = await asyncio.gather(*(self.pipeline.detokenize(tuple(ids), skip) for ids in lists))
        text = list(texts) if batch else texts[0]
        return JSONResponse({"text": text, "prompt": text})
