"""SGLang's native `/generate`: the contract RL frameworks speak (see docs/design.md, RL surface).

`text` or `input_ids`, one prompt or a batch, each with `sampling_params.n` samples: a single
prompt with n = 1 answers one object, anything else a list (SGLang's order: prompt-major). Streams
are cumulative (full text and lists so far in every event); a batch's events carry `index`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import msgspec

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.adapters import Adapters
from gateway.constraints import generate_constraint, refuse_outside_sampling_params
from gateway.errors import invalid
from gateway.experts import routed_fields
from gateway.fanout import first_outputs, gather_all, merged
from gateway.fields import (
    LOGPROB_START_LEN, MAX_NEW_TOKENS, RETURN_LOGPROB, RETURN_TEXT_IN_LOGPROBS, SAMPLING_PARAMS, STREAM, TOP_LOGPROBS_NUM,
)
from gateway.generation import Pipeline, Result
from gateway.http import read_body, sse_response, until_disconnect
from gateway.logprob_counts import LogprobCounts
from gateway.logprobs import sampled, sglang_entries
from gateway.params import (
    Returns, check, choices_count, custom_params, empty_prompt, get, read, refuse_unsupported, routed_experts_returns, sampling_params,
    seeded, token_ids, token_ids_logprob,
)
from jaxstream import protocol
from jaxstream.config import ServerConfig
from jaxstream.english import counted, listed

def finish_object(finish: protocol.FinishReason | None) -> dict | None:
    return None if finish is None else {k: v for k, v in (("type", finish.type), ("matched", finish.matched),
                                                          ("length", finish.length), ("message", finish.message))
                                        if v is not None or k == "type"}


class NativeRoutes:
    def __init__(self, pipeline: Pipeline, logprobs_mode: str, limits: ServerConfig, adapters: Adapters) -> None:
        self.pipeline = pipeline
        self.adapters = adapters  # SGLang's lora_path names one of them
        self.logprobs_mode = logprobs_mode  # the server's default
        self.limits = limits  # bounds on stop lists and logit bias (server.max_*)
        self.logprob_counts = LogprobCounts(pipeline, limits.max_logprobs)  # server.max_logprobs

    async def generate(self, request: Request) -> Response:
        started = time.monotonic()
        body = await read_body(request)
        refuse_unsupported(body)
        refuse_outside_sampling_params(body)
        prompts, batch = native_prompts(body)
        params = sampling_params_list(body, len(prompts))
        want_logprobs = read(body, RETURN_LOGPROB)
        top = await self.logprob_counts(read(body, TOP_LOGPROBS_NUM), "top_logprobs_num")
        start_len = read(body, LOGPROB_START_LEN)
        with_text = read(body, RETURN_TEXT_IN_LOGPROBS)
        ids, per_prompt = ids_per_prompt(body, len(prompts), batch)  # as SGLang, read only with return_logprob
        returns = Returns(top_logprobs=top if want_logprobs else 0,
                          prompt_logprobs_from=start_len if want_logprobs else -1, texts=want_logprobs and with_text,
                          mode=get(body, "logprobs_mode", str, None))  # checked with sampling_params' own (params.sampling_params)
        returns = routed_experts_returns(body, returns)
        layout = await self.pipeline.routed_layout() if returns.routed_experts else None
        loras = await self.adapters.lora_paths(body, len(prompts))  # SGLang's lora_path: one per prompt
        samplings = []
        for i, p in enumerate(params):
            prefix = f"sampling_params[{i}]." if isinstance(body.get("sampling_params"), list) else "sampling_params."
            refuse_unsupported(p, prefix=prefix)
            max_new = read(p, MAX_NEW_TOKENS, prefix=prefix)
            # As SGLang: 0 feeds the prompt and samples nothing (finish length 0), to score it
            # (return_logprob with logprob_start_len) or only to fill the prefix cache.
            asked = replace(returns, token_ids_logprob=ids[i] if want_logprobs else ())
            sampling = sampling_params(p, max_new, asked, where=SAMPLING_PARAMS, mode_default=self.logprobs_mode, prefix=prefix,
                                       max_tokens_name=prefix + "max_new_tokens",
                                       constraint=generate_constraint(p, prefix), limits=self.limits)
            custom_params(p, prefix=prefix)
            sampling = msgspec.structs.replace(sampling, lora=loras[i] or "")
            if sampling.ignore_eos:
                # SGLang's rule (schedule_batch.py, Req._check_token_based_finish): under ignore_eos no
                # stop token ends the output, the request's own stop_token_ids included (AReaL puts EOS
                # there and asks for fixed lengths so). Stop strings still apply. The OpenAI routes keep
                # vLLM's rule, where stop_token_ids still end it.
                sampling = msgspec.structs.replace(sampling, stop_token_ids=())
            samplings.append((sampling, choices_count(p, len(prompts), prefix=prefix), prefix + "max_new_tokens"))
        n = samplings[0][1]
        check(all(k == n for _, k, _ in samplings), "sampling_params", "every prompt of a batch must ask for the same n")
        # SGLang's words (io_struct.py, GenerateReqInput._normalize_logprob_params)
        if n > 1 and per_prompt:
            raise invalid("Cannot use list token_ids_logprob with parallel_sample_num > 1", "token_ids_logprob")
        rids = request_ids(body, len(prompts), n, self.pipeline.new_rid)
        groups = [self.pipeline.metrics.group(n, sampling.max_new_tokens) for sampling, _, _ in samplings]
        streams = [self.pipeline.stream(rids[p * n + j], seeded(samplings[p][0], j), groups[p], **prompt,
                                        max_tokens_name=samplings[p][2])
                   for p, prompt in enumerate(prompts) for j in range(n)]
        shape = MetaShape(rids, started, want_logprobs, top, with_text, await self.pipeline.current_version())
        shape.ids = [want_logprobs and bool(ids[p]) for p in range(len(prompts)) for _ in range(n)]
        shape.experts = None if layout is None else (returns.routed_experts_start_len, layout)
        many = batch or n > 1
        if read(body, STREAM):
            firsts = await first_outputs(streams)  # a rejection becomes an HTTP error, not a 200 stream
            return sse_response(shape.events(merged(firsts, streams), len(streams), many))
        results = await until_disconnect(request, gather_all(streams))
        payloads = [shape.payload(i, r) for i, r in enumerate(results)]
        return JSONResponse(payloads if many else payloads[0])


def native_prompts(body: dict) -> tuple[list[dict], bool]:
    """([prompt fields], whether the request is a batch)."""
    text, input_ids = body.get("text"), body.get("input_ids")
    check((text is None) != (input_ids is None), "text", "exactly one of 'text' and 'input_ids' must be given")
    if text is not None:
        texts = text if isinstance(text, list) else [text]
        check(bool(texts) and all(isinstance(t, str) for t in texts), "text", "must be a non-empty string or a non-empty list of them")
        if not all(texts):
            raise empty_prompt("text")
        return [{"text": t} for t in texts], isinstance(text, list)

    if isinstance(input_ids, list) and input_ids and all(isinstance(i, list) for i in input_ids):
        return [{"input_ids": token_ids(i, "input_ids")} for i in input_ids], True
    return [{"input_ids": token_ids(input_ids, "input_ids")}], False


def ids_per_prompt(body: dict, prompts: int, batch: bool) -> tuple[list[tuple[int, ...]], bool]:
    """SGLang's token_ids_logprob for each prompt (io_struct.py, GenerateReqInput._normalize_logprob_params):
    a list of ids for every prompt; or, in a batch, a list of lists, one per prompt (then True)."""
    value = body.get("token_ids_logprob")
    if not (batch and isinstance(value, list) and value and isinstance(value[0], list)):
        return [token_ids_logprob({"token_ids_logprob": value})] * prompts, False
    check(len(value) == prompts, "token_ids_logprob", f"gives {counted(len(value), 'list')} of ids for {counted(prompts, 'prompt')}: "
          "one per prompt")
    return [token_ids_logprob({f"token_ids_logprob[{i}]": v}, f"token_ids_logprob[{i}]") for i, v in enumerate(value)], True


def sampling_params_list(body: dict, prompts: int) -> list[dict]:
    """One `sampling_params` dict per prompt (a single dict applies to all)."""
    params = body.get("sampling_params", {})
    if params is None:
        params = {}
    if isinstance(params, dict):
        return [params] * prompts
    if isinstance(params, list) and len(params) == prompts and all(isinstance(p, dict) for p in params):
        return params
    raise invalid(f"'sampling_params' must be an object, or a list of {counted(prompts, 'object')} (one per prompt)", "sampling_params")


def request_ids(body: dict, prompts: int, n: int, new_rid) -> list[str]:
    """The pipeline rid of each (prompt, sample): the client's `rid` (one per prompt for a batch)
    suffixed with the sample's index when n > 1, else a fresh one."""
    rid = body.get("rid")
    if rid is None:
        base = [new_rid() for _ in range(prompts)]
    elif isinstance(rid, str) and prompts == 1:
        base = [rid]
    elif isinstance(rid, list) and len(rid) == prompts and all(isinstance(r, str) for r in rid):
        base = rid
    else:
        raise invalid(f"'rid' must be a string (one prompt) or a list of {counted(prompts, 'string')} (one per prompt)", "rid")
    check(all(base), "rid", "request ids must not be empty")
    if duplicates := sorted({json.dumps(b) for b in base if base.count(b) > 1}):
        raise invalid(f"Duplicate request ID {listed(duplicates)} in 'rid': the ids of a batch must be distinct", "rid")
    return [b if n == 1 else f"{b}-{j}" for b in base for j in range(n)]


class MetaShape:
    """SGLang's `{"text", "output_ids", "meta_info"}` for one (prompt, sample)."""

    def __init__(self, rids: list[str], started: float, logprobs: bool, top: int, with_text: bool, version: str) -> None:
        self.rids, self.started = rids, started
        self.version = version  # of the weights when the request came: a result with no token reports it
        self.logprobs, self.top, self.with_text = logprobs, top, with_text
        self.experts: tuple[int, tuple[int, int]] | None = None  # asked: (start_len, (layers, experts per token))
        self.ids = [False] * len(rids)  # per (prompt, sample): token_ids_logprob asked (with return_logprob)

    def payload(self, index: int, result: Result) -> dict:
        meta = {
            "id": self.rids[index],
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "cached_tokens": result.cached_tokens,
            "finish_reason": finish_object(result.finish),
            # The version that computed its tokens; each span's when an update fell between them.
            "weight_version": result.weight_spans[-1][0] if result.weight_spans else self.version,
            "weight_versions": [{"version": v, "start": a, "end": b} for v, a, b in result.weight_spans],
            "e2e_latency": time.monotonic() - self.started,
        }
        if self.logprobs:
            meta["output_token_logprobs"] = sglang_entries(sampled(result), self.with_text)
            meta["input_token_logprobs"] = sglang_entries(result.prompt_logprobs, self.with_text)
            if self.top:
                meta["output_top_logprobs"] = [sglang_entries(list(t), self.with_text) for t in result.top_logprobs]
                meta["input_top_logprobs"] = [sglang_entries(list(t), self.with_text) if t else None
                                              for t in result.prompt_top_logprobs]
            if self.ids[index]:  # SGLang's: per position [[logprob, id, text], ...] in the asked order; null at prompt position 0
                meta["output_token_ids_logprobs"] = [sglang_entries(list(t), self.with_text) for t in result.token_ids_logprobs]
                meta["input_token_ids_logprobs"] = [sglang_entries(list(t), self.with_text) if t else None
                                                    for t in result.prompt_token_ids_logprobs]
        if self.experts is not None and result.finish is not None:  # they come with the last output
            meta.update(routed_fields(result.routed_experts, *self.experts))
        return {"text": result.text, "output_ids": result.token_ids, "meta_info": meta}

    async def events(self, outputs: AsyncIterator[tuple[int, protocol.RequestOutput]], count: int, many: bool) -> AsyncIterator[str]:
        results = [Result() for _ in range(count)]
        try:
            async for index, out in outputs:
                results[index].add(out)
                payload = self.payload(index, results[index])  # cumulative, as SGLang
                if many:
                    payload["index"] = index
                yield json.dumps(payload)
        finally:
            await outputs.aclose()
