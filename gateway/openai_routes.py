"""`/v1/chat/completions`, `/v1/completions`, `/v1/models`: OpenAI's request and response shapes."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import ApiError, invalid
from gateway.generation import Engine, Result, gather
from gateway.http import read_body, sse_response, until_disconnect
from gateway.params import chat_messages, check, get, refuse_unsupported, sampling_params, stream_flags
from jaxstream import protocol


def finish_reason(finish: protocol.FinishReason | None) -> str | None:
    return None if finish is None else finish.type


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class OpenAIRoutes:
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def check_model(self, body: dict) -> None:
        model = get(body, "model", str, None)
        if model is not None and model not in (self.model_name, "default"):
            raise ApiError(404, f"The model '{model}' does not exist", "model", "model_not_found")

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "jaxstream", "root": self.model_name},
        ]})

    async def chat(self, request: Request) -> Response:
        body = await read_body(request)
        self.check_model(body)
        refuse_unsupported(body)
        max_tokens = get(body, "max_completion_tokens", int, None)
        if max_tokens is None:
            max_tokens = get(body, "max_tokens", int, None)
        prompt = {"messages": chat_messages(body)}
        return await self._respond(request, body, max_tokens, prompt, chat=True)

    async def completions(self, request: Request) -> Response:
        body = await read_body(request)
        self.check_model(body)
        refuse_unsupported(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            check(bool(prompt), "prompt", "must not be empty")
            prompt_fields = {"text": prompt}
        elif isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            check(bool(prompt), "prompt", "must not be empty")
            check(all(i >= 0 for i in prompt), "prompt", "token ids must be >= 0")
            prompt_fields = {"input_ids": tuple(prompt)}
        elif isinstance(prompt, list):
            raise invalid("'prompt' as a batch of several prompts is not supported by this server yet", "prompt")
        else:
            raise invalid("'prompt' must be a string or a list of token ids", "prompt")
        max_tokens = get(body, "max_tokens", int, 16)
        return await self._respond(request, body, max_tokens, prompt_fields, chat=False)

    async def _respond(self, request: Request, body: dict, max_tokens: int | None, prompt: dict, *, chat: bool) -> Response:
        sampling = sampling_params(body, max_tokens)
        stream, include_usage = stream_flags(body)
        rid = self.engine.new_rid()
        shape = ChatShape(rid, self.model_name) if chat else CompletionShape(rid, self.model_name)
        outputs = self.engine.stream(rid, sampling, **prompt)
        if stream:
            first = await anext(outputs)  # a rejection becomes an HTTP error, not a 200 stream
            return sse_response(shape.chunks(first, outputs, include_usage))
        result = await until_disconnect(request, gather(outputs))
        return JSONResponse(shape.whole(result))


class Shape:
    """The envelope OpenAI puts around choices, for one response or stream."""

    id_prefix = chunk_object = whole_object = ""

    def __init__(self, rid: str, model: str) -> None:
        self.id, self.model, self.created = f"{self.id_prefix}-{rid}", model, int(time.time())

    def _envelope(self, obj: str, choices: list, usage_: dict | None) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, "usage": usage_}

    def _chunk(self, choices: list, usage_: dict | None = None) -> str:
        return json.dumps(self._envelope(self.chunk_object, choices, usage_))

    def _whole(self, choice: dict, result: Result) -> dict:
        return self._envelope(self.whole_object, [choice], usage(result.prompt_tokens, result.completion_tokens))


class ChatShape(Shape):
    id_prefix, chunk_object, whole_object = "chatcmpl", "chat.completion.chunk", "chat.completion"

    async def chunks(self, first: protocol.RequestOutput, rest: AsyncIterator[protocol.RequestOutput], include_usage: bool) -> AsyncIterator[str]:
        yield self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
        last = first
        async for out in _chain(first, rest):
            last = out
            if out.text:
                yield self._chunk([{"index": 0, "delta": {"content": out.text}, "logprobs": None, "finish_reason": None}])
            if out.finish is not None:
                yield self._chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason(out.finish)}])
        if include_usage:
            yield self._chunk([], usage(last.prompt_tokens, last.completion_tokens))

    def whole(self, result: Result) -> dict:
        return self._whole({"index": 0, "message": {"role": "assistant", "content": result.text},
                            "logprobs": None, "finish_reason": finish_reason(result.finish)}, result)


class CompletionShape(Shape):
    id_prefix, chunk_object, whole_object = "cmpl", "text_completion", "text_completion"

    async def chunks(self, first: protocol.RequestOutput, rest: AsyncIterator[protocol.RequestOutput], include_usage: bool) -> AsyncIterator[str]:
        last = first
        async for out in _chain(first, rest):
            last = out
            if out.text or out.finish is not None:
                yield self._chunk([{"index": 0, "text": out.text, "logprobs": None, "finish_reason": finish_reason(out.finish)}])
        if include_usage:
            yield self._chunk([], usage(last.prompt_tokens, last.completion_tokens))

    def whole(self, result: Result) -> dict:
        return self._whole({"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish_reason(result.finish)}, result)


async def _chain(first: protocol.RequestOutput, rest: AsyncIterator[protocol.RequestOutput]) -> AsyncIterator[protocol.RequestOutput]:
    """`first`, then the rest; closing this closes `rest`, which aborts an unfinished request."""
    try:
        yield first
        if first.finish is None:
            async for out in rest:
                yield out
    finally:
        await rest.aclose()
