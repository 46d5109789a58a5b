"""SGLang's native `/generate`: the contract RL frameworks speak (see DESIGN.md, RL surface)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.generation import Engine, Result, gather
from gateway.http import read_body, sse_response, until_disconnect
from gateway.params import check, get, refuse_unsupported, sampling_params
from jaxstream import protocol


def finish_object(finish: protocol.FinishReason | None) -> dict | None:
    return None if finish is None else {k: v for k, v in (("type", finish.type), ("matched", finish.matched),
                                                          ("length", finish.length), ("message", finish.message))
                                        if v is not None or k == "type"}


class NativeRoutes:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def generate(self, request: Request) -> Response:
        started = time.monotonic()
        body = await read_body(request)
        refuse_unsupported(body)
        text, input_ids = body.get("text"), body.get("input_ids")
        check((text is None) != (input_ids is None), "text", "exactly one of 'text' and 'input_ids' must be given")
        if text is not None:
            check(isinstance(text, str) and bool(text), "text", "must be a non-empty string (batches are not supported yet)")
            prompt = {"text": text}
        else:
            ok = isinstance(input_ids, list) and input_ids and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in input_ids)
            check(bool(ok), "input_ids", "must be a non-empty list of non-negative integers (batches are not supported yet)")
            prompt = {"input_ids": tuple(input_ids)}
        params = get(body, "sampling_params", dict, {})
        refuse_unsupported(params, prefix="sampling_params.")
        max_new = get(params, "max_new_tokens", int, 128, prefix="sampling_params.")
        sampling = sampling_params(params, max_new, prefix="sampling_params.")
        rid = get(body, "rid", str, None) or self.engine.new_rid()
        check(rid not in self.engine.router.queues, "rid", f"'{rid}' is already in use by a running request")
        outputs = self.engine.stream(rid, sampling, **prompt)

        def payload(result: Result) -> dict:
            return {"text": result.text, "output_ids": result.token_ids, "meta_info": {
                "id": rid,
                "prompt_tokens": result.prompt_tokens,
                "completion_tokens": result.completion_tokens,
                "finish_reason": finish_object(result.finish),
                "e2e_latency": time.monotonic() - started,
            }}

        if get(body, "stream", bool, False):
            first = await anext(outputs)  # a rejection becomes an HTTP error, not a 200 stream

            async def events() -> AsyncIterator[str]:
                result = Result()
                try:
                    result.add(first)
                    yield json.dumps(payload(result))  # cumulative text per chunk, as SGLang
                    if first.finish is None:
                        async for out in outputs:
                            result.add(out)
                            yield json.dumps(payload(result))
                finally:
                    await outputs.aclose()

            return sse_response(events())
        result = await until_disconnect(request, gather(outputs))
        return JSONResponse(payload(result))
