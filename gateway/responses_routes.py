"""`/v1/responses`: OpenAI's Responses API, served as one chat completion.

1. `instructions` (a system message, first), the conversation of `previous_response_id` and
   `input` become chat messages; the sampling fields are read by the chat route's own functions.
2. The messages run through `Pipeline.stream` as one request, exactly as a chat completion of one
   choice: same template, same tokens. One difference, OpenAI's: an input that ends with an
   assistant message gets a new assistant turn after it (chat continues that message instead).
3. The answer is a `response` object with one `message` output item holding one `output_text`
   part; streamed, OpenAI's typed events (`event:` and `data:` lines, each with an increasing
   `sequence_number`), from `response.created` to `response.completed` (`response.incomplete` when
   cut by max_output_tokens, `response.failed` when the pipeline fails after the stream began).

4. A response asked to be stored (`store`, true by default, as OpenAI's) is kept whole, with its
   conversation, in this gateway's memory (`server.responses_store_size` of them, the least recently
   used dropped first): `GET /v1/responses/{id}` returns it, `DELETE` forgets it, and
   `previous_response_id` continues its conversation. Another gateway, or this one restarted, does
   not know it. A failed response is not stored.

`text.format` constrains the output as chat's `response_format` does (gateway/constraints.py);
`chat_template_kwargs` reach the template as chat's do. A model with a reasoning parser
(model.reasoning_parser, gateway/reasoning.py) has its thinking in a `reasoning` output item (one
`reasoning_text` part, streamed as `response.reasoning_text.delta` events) before the message; the
message's logprobs are still every token's, the thinking's too; a stored conversation keeps the
answer alone. What a field asks for and is not built here (tools, reasoning effort or summaries,
a verbosity, background runs, server-side conversations, ...) is refused with a 400 naming it,
never ignored.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.constraints import responses_constraint
from gateway.errors import ApiError, invalid
from gateway.fanout import first_outputs, gather_all, merged
from gateway.fields import (
    INCLUDE, INSTRUCTIONS, MAX_OUTPUT_TOKENS, METADATA, PARALLEL_TOOL_CALLS, PREVIOUS_RESPONSE_ID, RESPONSES, RESPONSES_TOOL_CHOICE,
    STORE, STREAM, TOP_LOGPROBS, USER,
)
from gateway.generation import Result
from gateway.http import EventStream, read_body, until_disconnect
from gateway.logprobs import ChatLogprobs
from gateway.messages import template_kwargs
from gateway.openai_routes import OpenAIRoutes
from gateway.params import Returns, check, empty_prompt, read, refuse_unsupported, sampling_params
from gateway.reasoning import Thinking, thinks
from jaxstream import protocol
from jaxstream.config import ServerConfig
from jaxstream.protocol import ChatMessage

log = logging.getLogger(__name__)

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512  # OpenAI's bounds on metadata's keys and values (its pairs: the table's)


def _unless(*allowed):
    return lambda v: v not in (None, *allowed)


def _reasoning_asked(v) -> bool:
    return not (isinstance(v, dict) and v.get("effort") in (None, "none") and not v.get("summary") and not v.get("generate_summary"))


# The Responses API's own fields whose meaning is not built: (whether the value asks for it, what).
RESPONSES_NOT_YET = {
    "tools": (_unless([]), "tool calling"),
    "tool_choice": (_unless("none", "auto"), "forcing a tool call"),
    "reasoning": (lambda v: v is not None and _reasoning_asked(v), "reasoning effort or summaries"),
    "text": (lambda v: isinstance(v, dict) and v.get("verbosity") is not None, "a text verbosity"),
    "background": (_unless(False), "background responses"),
    "truncation": (_unless("disabled"), "truncating the input to fit ('auto')"),
    "include": (lambda v: v is not None and not (isinstance(v, list) and all(item == LOGPROBS_INCLUDE for item in v)),
                f"included items other than {LOGPROBS_INCLUDE}"),
    "prompt": (_unless(), "prompt templates"),
    "conversation": (_unless(), "server-side conversations"),
    "context_management": (_unless(), "context management"),
    "moderation": (_unless(), "moderation"),
}


def refuse_unimplemented(body: dict) -> None:
    refuse_unsupported(body, table=RESPONSES_NOT_YET)
    # chat's extensions that apply here too (constrained decoding, LoRA, ...); tools are ours
    OpenAIRoutes.refuse({k: v for k, v in body.items() if k not in RESPONSES_NOT_YET})


def input_messages(value: object) -> list[ChatMessage]:
    """`input`: a string (one user message) or a list of message items, whose content is a string
    or text parts (`input_text`, or `output_text` as a previous answer holds)."""
    if isinstance(value, str):
        if not value:
            raise empty_prompt("input")
        return [ChatMessage("user", value)]
    check(isinstance(value, list) and bool(value), "input", "must be a non-empty string or a non-empty list of message items")
    messages = []
    for i, item in enumerate(value):
        name = f"input[{i}]"
        check(isinstance(item, dict), name, "must be an object")
        kind = item.get("type", "message")
        check(kind == "message", f"{name}.type", f"must be \"message\": items of type {json.dumps(kind)} are not supported")
        role = item.get("role")
        check(role in ROLES, f"{name}.role", f"must be one of {', '.join(ROLES)}; got {json.dumps(role)}")
        content = item.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                part_kind = part.get("type") if isinstance(part, dict) else None
                check(part_kind in TEXT_PARTS, f"{name}.content[{j}].type",
                      f"must be one of {', '.join(TEXT_PARTS)}; {json.dumps(part_kind)} parts are not supported")
                check(isinstance(part.get("text"), str), f"{name}.content[{j}].text", "must be a string")
            content = "".join(part["text"] for part in content)
        check(isinstance(content, str), f"{name}.content", "must be a string or a list of text parts")
        messages.append(ChatMessage("system" if role == "developer" else role, content))
    return messages


def metadata_of(body: dict) -> dict[str, str]:
    metadata = read(body, METADATA) or {}
    check(len(metadata) <= METADATA.max_items and all(
        isinstance(v, str) and len(k) <= MAX_METADATA_KEY and len(v) <= MAX_METADATA_VALUE for k, v in metadata.items()),
        "metadata", f"must hold at most {METADATA.max_items} pairs of strings (keys up to {MAX_METADATA_KEY} characters, "
                    f"values up to {MAX_METADATA_VALUE})")
    return metadata


@dataclass(frozen=True)
class Stored:
    conversation: tuple[ChatMessage, ...]  # the messages it was given (not its instructions: OpenAI does not carry them over) and its answer
    response: dict  # the `response` object as it was returned


class ResponseStore:
    """The last `size` stored responses, by id (the least recently used dropped first). In this
    gateway's memory only: another gateway, or this one restarted, does not know them."""

    def __init__(self, size: int = ServerConfig.responses_store_size) -> None:
        self.size = size
        self.entries: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> tuple[ChatMessage, ...]:
        """The conversation `previous_response_id` continues; a 400 naming that field when it is not kept."""
        if response_id not in self.entries:
            raise invalid(f"Previous response with id '{response_id}' not found (this gateway keeps the last {self.size}).",
                          "previous_response_id", "previous_response_not_found")
        self.entries.move_to_end(response_id)
        return self.entries[response_id].conversation

    def response(self, response_id: str) -> dict:
        """The stored `response` object; a 404 in vLLM's words when it is not kept."""
        if response_id not in self.entries:
            raise not_found(response_id)
        self.entries.move_to_end(response_id)
        return self.entries[response_id].response

    def put(self, response_id: str, conversation: tuple[ChatMessage, ...], response: dict) -> None:
        self.entries[response_id] = Stored(conversation, response)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def delete(self, response_id: str) -> None:
        if self.entries.pop(response_id, None) is None:
            raise not_found(response_id)


def not_found(response_id: str) -> ApiError:
    """vLLM's words (entrypoints/openai/responses/serving.py, _make_not_found_error)."""
    return ApiError(404, f"Response with id '{response_id}' not found.", "response_id")


def response_id_of(request: Request) -> str:
    """The path's id; one that is not a response's is vLLM's 400 (serving.py, _make_invalid_id_error)."""
    response_id = request.path_params["response_id"]
    if not response_id.startswith("resp"):
        raise invalid(f"Invalid 'response_id': '{response_id}'. Expected an ID that begins with 'resp'.", "response_id")
    return response_id


class ResponsesRoutes:
    def __init__(self, openai: OpenAIRoutes, store: ResponseStore) -> None:
        self.openai = openai  # the chat route's pipeline, model, logprobs default and limits
        self.store = store

    async def create(self, request: Request) -> Response:
        body = await read_body(request)
        lora = await self.openai.check_model(body)
        if self.openai.harmony:  # its output items would need Harmony's channels read here as chat reads them
            raise ApiError(400, "the Responses API is not served for a Harmony model (GPT-OSS) yet: use /v1/chat/completions", "model")
        refuse_unimplemented(body)
        instructions = read(body, INSTRUCTIONS)
        previous = read(body, PREVIOUS_RESPONSE_ID)
        given = (*(self.store.get(previous) if previous else ()), *input_messages(body.get("input")))
        messages = ((ChatMessage("system", instructions),) if instructions else ()) + given
        top = await self.openai.logprob_counts(read(body, TOP_LOGPROBS), "top_logprobs")
        wants = LOGPROBS_INCLUDE in (read(body, INCLUDE) or []) or top > 0
        max_tokens = read(body, MAX_OUTPUT_TOKENS)
        sampling = sampling_params(body, max_tokens, Returns(top_logprobs=top, texts=wants), where=RESPONSES,
                                   mode_default=self.openai.logprobs_mode, max_tokens_name="max_output_tokens",
                                   constraint=responses_constraint(body), limits=self.openai.limits)
        sampling = msgspec.structs.replace(sampling, lora=lora)
        store, streamed = read(body, STORE), read(body, STREAM)
        shape = ResponseShape(self.openai.pipeline.new_rid(), self.openai.model_name, ChatLogprobs() if wants else None, {
            "instructions": instructions, "max_output_tokens": max_tokens, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "top_logprobs": top, "tools": [], "tool_choice": read(body, RESPONSES_TOOL_CHOICE),
            "parallel_tool_calls": read(body, PARALLEL_TOOL_CALLS),
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "metadata": metadata_of(body), "previous_response_id": previous, "store": store,
            "user": read(body, USER), "truncation": "disabled", "reasoning": None, "background": False,
        }, thinks=thinks(self.openai.reasoning_parser, body) and sampling.constraint is None)  # constrained: all answer
        remember = self.remembering(shape.id, given) if store else None
        stream = self.openai.pipeline.stream(shape.rid, sampling, messages=messages, max_tokens_name="max_output_tokens",
                                             chat_template_kwargs=template_kwargs(body))
        if streamed:
            firsts = await first_outputs([stream])  # a rejection becomes an HTTP error, not a 200 stream
            return EventStream(sse(shape.events(merged(firsts, [stream]), remember)), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
        (result,) = await until_disconnect(request, gather_all([stream]))
        whole = shape.whole(result)
        if remember and whole["status"] != "failed":
            remember(shape.split(result.text)[1], whole)
        return JSONResponse(whole)

    def remembering(self, response_id: str, given: tuple[ChatMessage, ...]) -> Callable[[str, dict], None]:
        """What stores a response once it ended: its answer's text and its `response` object."""
        return lambda text, whole: self.store.put(response_id, (*given, ChatMessage("assistant", text)), whole)

    async def stored(self, request: Request) -> Response:
        """/v1/responses/{id}: GET returns a stored response as it was returned (OpenAI's retrieve),
        DELETE forgets it (OpenAI's delete)."""
        response_id = response_id_of(request)
        if request.method == "DELETE":
            self.store.delete(response_id)
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise invalid("streaming a stored response again ('stream') is not supported by this server yet", "stream")
        return JSONResponse(self.store.response(response_id))


async def sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Each event as its `event:` and `data:` lines; closing this closes the request's outputs,
    which aborts the request (EventStream closes it when the client leaves)."""
    try:
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
    finally:
        await events.aclose()


def usage(result: Result) -> dict:
    """OpenAI's Responses usage, with chat's names for the same counts beside (clients written for
    chat completions read `prompt_tokens` and `completion_tokens`)."""
    return {"input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": result.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": result.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens}


def status_of(finish: protocol.FinishReason | None) -> tuple[str, dict | None, dict | None]:
    """(status, incomplete_details, error) of a request that ended so."""
    if finish is None or finish.type in ("stop", "length"):
        incomplete = finish is not None and finish.type == "length"
        return ("incomplete", {"reason": "max_output_tokens"}, None) if incomplete else ("completed", None, None)
    return "failed", None, {"code": "server_error", "message": f"the request ended with {finish.type}: {finish.message or ''}"}


class ResponseShape:
    """The `response` object of one request, whole or as the stream's events."""

    def __init__(self, rid: str, model: str, logprobs: ChatLogprobs | None, echoed: dict, thinks: bool = False) -> None:
        self.rid, self.model, self.logprobs, self.echoed = rid, model, logprobs, echoed
        self.id, self.item_id, self.created_at = f"resp_{rid}", f"msg_{rid}", int(time.time())
        self.sequence = 0
        self.thinks = thinks  # the output is read for thinking: a reasoning item before the message
        self.opened: list[str] = []  # the stream's output items, in order: "reasoning", "message"

    def split(self, text: str) -> tuple[str, str]:
        """(the thinking, the answer) of a whole output."""
        if not self.thinks:
            return "", text
        reader = Thinking()
        pieces = reader.feed(text) + reader.finish()
        return ("".join(p.reasoning for p in pieces if p.reasoning is not None),
                "".join(p.content for p in pieces if p.content is not None))

    def response(self, status: str, output: list[dict], result: Result | None = None,
                 incomplete: dict | None = None, error: dict | None = None) -> dict:
        metadata = dict(self.echoed["metadata"])
        if result is not None and result.weight_spans:  # an extension, as chat's: the weights of the last tokens
            metadata["weight_version"] = result.weight_spans[-1][0]
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status, "model": self.model,
                "output": output, "incomplete_details": incomplete, "error": error, **self.echoed, "metadata": metadata,
                "usage": usage(result) if result is not None else None}

    def _logprobs(self, result: Result) -> list[dict]:
        return self.logprobs.of(result)["content"] if self.logprobs else []

    def _part(self, result: Result, text: str | None = None) -> dict:
        return {"type": "output_text", "text": result.text if text is None else text, "annotations": [],
                "logprobs": self._logprobs(result)}

    def _message(self, status: str, content: list[dict]) -> dict:
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def _reasoning(self, status: str, text: str | None) -> dict:
        """OpenAI's reasoning item (vLLM's: no summary, the thinking as one reasoning_text part)."""
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": f"rs_{self.rid}", "status": status, "summary": [], "content": content,
                "encrypted_content": None}

    def _output(self, result: Result, item_status: str) -> list[dict]:
        thought, answer = self.split(result.text)
        message = self._message(item_status, [self._part(result, answer)])
        return [self._reasoning(item_status, thought), message] if thought else [message]

    def whole(self, result: Result) -> dict:
        status, incomplete, error = status_of(result.finish)
        item_status = "completed" if status == "completed" else "incomplete"
        return self.response(status, self._output(result, item_status), result, incomplete, error)

    def _event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _where(self, kind: str) -> dict:
        item_id = self.item_id if kind == "message" else f"rs_{self.rid}"
        return {"item_id": item_id, "output_index": self.opened.index(kind), "content_index": 0}

    def _open(self, kind: str) -> list[dict]:
        """The events that open an output item ("reasoning" or "message"), once."""
        if kind in self.opened:
            return []
        self.opened.append(kind)
        if kind == "reasoning":
            return [self._event("response.output_item.added", output_index=len(self.opened) - 1, item=self._reasoning("in_progress", None))]
        return [self._event("response.output_item.added", output_index=len(self.opened) - 1, item=self._message("in_progress", [])),
                self._event("response.content_part.added", **self._where("message"), part=self._part(Result()))]

    def _close(self, whole: dict, result: Result) -> list[dict]:
        """The events that end each opened item, the message's last (opened now if no answer came)."""
        events = self._open("message")
        thought, answer = self.split(result.text)
        for index, kind in enumerate(self.opened):
            if kind == "reasoning":
                events.append(self._event("response.reasoning_text.done", **self._where(kind), text=thought))
            else:
                part = self._part(result, answer)
                events.append(self._event("response.output_text.done", **self._where(kind), text=answer, logprobs=part["logprobs"]))
                events.append(self._event("response.content_part.done", **self._where(kind), part=part))
            events.append(self._event("response.output_item.done", output_index=index, item=whole["output"][index]))
        return events

    def _deltas(self, out: protocol.RequestOutput, thinking: Thinking | None) -> list[dict]:
        """An output's text as delta events: all the message's, or read for thinking (then with no
        logprobs: the whole response's part has every token's)."""
        if thinking is None:
            if not (out.text or (self.logprobs and out.token_ids)):
                return []
            piece = Result()
            piece.add(out)
            return [self._event("response.output_text.delta", **self._where("message"), delta=out.text,
                                logprobs=self._logprobs(piece))]
        events = []
        for piece in thinking.feed(out.text) + (thinking.finish() if out.finish is not None else []):
            kind = "reasoning" if piece.reasoning is not None else "message"
            events += self._open(kind)
            if kind == "reasoning":
                events.append(self._event("response.reasoning_text.delta", **self._where(kind), delta=piece.reasoning))
            else:
                events.append(self._event("response.output_text.delta", **self._where(kind), delta=piece.content, logprobs=[]))
        return events

    async def events(self, outputs: AsyncIterator[tuple[int, protocol.RequestOutput]], remember) -> AsyncIterator[dict]:
        """OpenAI's event sequence; a failure after it began ends it with `response.failed`. Without
        thinking the message opens at once; with it, each item as its first text comes."""
        result = Result()
        thinking = Thinking() if self.thinks else None
        try:
            opening = self.response("in_progress", [])
            yield self._event("response.created", response=opening)
            yield self._event("response.in_progress", response=opening)
            for event in [] if thinking else self._open("message"):
                yield event
            try:
                async for _, out in outputs:
                    result.add(out)
                    for event in self._deltas(out, thinking):
                        yield event
            except Exception as exc:  # after the 200 went out: the response fails, the stream still ends whole
                if not isinstance(exc, ApiError):
                    log.exception("streamed response %s failed", self.id, exc_info=exc)
                message = exc.message if isinstance(exc, ApiError) else f"internal error: {type(exc).__name__}"
                error = {"code": "server_error", "message": message}
                failed = self.response("failed", self._output(result, "incomplete"), result, None, error)
                yield self._event("response.failed", response=failed)
                return
            whole = self.whole(result)
            for event in self._close(whole, result):
                yield event
            if remember and whole["status"] != "failed":
                remember(self.split(result.text)[1], whole)
            ending = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(whole["status"], "response.failed")
            yield self._event(ending, response=whole)
        finally:
            await outputs.aclose()  # the request's outputs: closing them early aborts it
