"""`/v1/chat/completions`, `/v1/completions`, `/v1/models`: OpenAI's request and response shapes.

One HTTP request may hold several prompts (completions) and `n` samples of each: every (prompt,
sample) pair is its own pipeline request, choice index `prompt * n + sample`, joined back by
`fanout`. Logprobs come back in OpenAI's two formats (`logprobs.py`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.constraints import openai_constraint
from gateway.adapters import Adapters, model_not_found
from gateway.errors import ApiError, invalid
from gateway.experts import routed_fields
from gateway.fanout import first_outputs, gather_all, merged
from gateway.fields import (
    CHAT, CHAT_LOGPROBS, CHAT_MAX_TOKENS, COMPLETION_LOGPROBS, COMPLETION_MAX_TOKENS, COMPLETIONS, ECHO, MAX_COMPLETION_TOKENS, MODEL,
    RETURN_TOKEN_IDS, RETURN_TOKENS_AS_TOKEN_IDS, TOP_LOGPROBS,
)
from gateway.generation import Pipeline, Result
from gateway.harmony import HarmonyReading, harmony_kwargs, harmony_turn
from gateway.http import read_body, sse_response, until_disconnect
from gateway.logprob_counts import LogprobCounts
from gateway.logprobs import ChatLogprobs, CompletionLogprobs, vllm_prompt_logprobs
from gateway.messages import chat_messages, template_kwargs
from gateway.params import (
    Returns, chat_continuation, check, choices_count, continuous_usage, empty_prompt, prompt_logprobs_count, read,
    refuse_unsupported, routed_experts_returns, sampling_params, seeded, stream_flags, token_ids, truncation,
)
from gateway.reasoning import Reading, Thinking, thinks
from gateway.tools import CONSTRAINT_FIELDS, ToolUse, tool_use
from jaxstream import protocol
from jaxstream.config import ServerConfig


def finish_reason(finish: protocol.FinishReason | None) -> str | None:
    return None if finish is None else finish.type


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def continued_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """vLLM's continuous_usage_stats in a chunk (serving_chat.py and serving_completion.py, the
    stream generators): the chunk's own choice alone, its prompt and its tokens up to and including
    the chunk's (0 in chat's opening role chunk), without the cached-token details."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


class OpenAIRoutes:
    def __init__(self, pipeline: Pipeline, model_name: str, logprobs_mode: str, limits: ServerConfig,
                 tool_parser: str = "hermes", reasoning_parser: str | None = None) -> None:
        self.pipeline = pipeline
        self.model_name = model_name
        self.adapters = Adapters(pipeline.bus, model_name)  # the LoRA adapters a request may name as its model
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser  # model.tool_parser, model.reasoning_parser
        self.harmony = tool_parser == "openai"  # GPT-OSS: chats rendered and read by Harmony's channels (gateway/harmony.py)
        self.logprobs_mode = logprobs_mode  # the server's default
        self.limits = limits  # bounds on stop lists and logit bias (server.max_*)
        self.logprob_counts = LogprobCounts(pipeline, limits.max_logprobs)  # -1 and server.max_logprobs

    @staticmethod
    def refuse(body: dict) -> None:
        """What these routes do not serve: the peers' unbuilt fields, and logprobs of given ids
        (SGLang's token_ids_logprob, which /generate serves)."""
        refuse_unsupported(body)
        for name in ("token_ids_logprob", "logprob_token_ids"):
            check(not body.get(name), name, "(logprobs of given token ids) is served on /generate (SGLang's token_ids_logprob), "
                                            "not on the OpenAI routes")

    async def check_model(self, body: dict) -> str:
        """The LoRA adapter the request names (gateway/adapters.py): by `lora_path`, else by `model`; "" for the base model."""
        return await self.adapters.request_adapter(body, read(body, MODEL))

    def card(self, max_model_len: int | None) -> dict:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "jaxstream", "root": self.model_name, "parent": None}
        if max_model_len:
            card["max_model_len"] = max_model_len
        return card

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.card(await self.pipeline.max_model_len()), *await self.adapters.cards()]})

    async def model(self, request: Request) -> Response:
        model = request.path_params["model"]
        if model == self.model_name:
            return JSONResponse(self.card(await self.pipeline.max_model_len()))
        if card := [c for c in await self.adapters.cards() if c["id"] == model]:
            return JSONResponse(card[0])
        raise model_not_found(model)

    async def chat(self, request: Request) -> Response:
        body = await read_body(request)
        lora = await self.check_model(body)
        # a Harmony model takes OpenAI's reasoning_effort (its system message says it), which others refuse
        self.refuse({k: v for k, v in body.items() if k != "reasoning_effort"} if self.harmony else body)
        max_tokens, max_tokens_name = read(body, MAX_COMPLETION_TOKENS), "max_completion_tokens"
        if max_tokens is None:
            max_tokens, max_tokens_name = read(body, CHAT_MAX_TOKENS), "max_tokens"
        wants = read(body, CHAT_LOGPROBS)
        top = read(body, TOP_LOGPROBS)
        if top and not wants:  # vLLM's words (chat_completion/protocol.py, ChatCompletionRequest.check_logprobs)
            raise invalid("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        top = await self.logprob_counts(top, "top_logprobs")
        prompt_top = await self.logprob_counts(prompt_logprobs_count(body), "prompt_logprobs", "prompt")
        returns = Returns(top_logprobs=top, prompt_logprobs_from=-1 if prompt_top is None else 0, texts=wants or prompt_top is not None,
                          prompt_top_logprobs=-1 if prompt_top is None else prompt_top)
        logprobs = ChatLogprobs(as_ids=read(body, RETURN_TOKENS_AS_TOKEN_IDS)) if wants else None
        messages = chat_messages(body)
        continuation = chat_continuation(harmony_turn(body, messages) if self.harmony else body, messages)
        tools = tool_use(body, self.tool_parser)
        prompts = [{"messages": messages, **continuation, **truncation(body), "tools": tools.rendered(),
                    "chat_template_kwargs": harmony_kwargs(body) if self.harmony else template_kwargs(body)}]
        if self.harmony and tools.choice == "named":  # its header ends the prompt: the output is the arguments, as any named call's
            prompts[0]["forced_call"] = tools.name
        shape = ChatShape(self.pipeline.new_rid(), lora or self.model_name, logprobs, tools, thinks(self.reasoning_parser, body),
                          reasons=self.reasoning_parser is not None, channels=self.harmony)
        # vLLM's echo: a continued assistant message comes back whole, its given part first
        shape.echo = messages[-1].content if read(body, ECHO) and messages[-1].role == "assistant" else ""
        shape.extras = Extras(prompt_top, read(body, RETURN_TOKEN_IDS))
        shape.lora = lora
        return await self._respond(request, body, CHAT, max_tokens, returns, prompts, shape, max_tokens_name)

    async def completions(self, request: Request) -> Response:
        body = await read_body(request)
        lora = await self.check_model(body)
        self.refuse(body)
        prompts = completion_prompts(body.get("prompt"))
        logprobs = await self.logprob_counts(read(body, COMPLETION_LOGPROBS), "logprobs")
        top = logprobs or 0
        echo = read(body, ECHO)
        prompt_top = await self.logprob_counts(prompt_logprobs_count(body), "prompt_logprobs", "prompt")
        truncated = truncation(body)
        check(not (echo and truncated["truncate_prompt_tokens"] is not None), "truncate_prompt_tokens",
              "cannot be used with echo (the echoed prompt would not be the one run)")
        echo_scores = echo and logprobs is not None  # the echoed prompt's logprobs, with `top` alternatives
        returns = Returns(top_logprobs=top, prompt_logprobs_from=0 if echo_scores or prompt_top is not None else -1,
                          texts=logprobs is not None or prompt_top is not None,
                          prompt_top_logprobs=-1 if prompt_top is None else max(prompt_top, top if echo_scores else 0))
        shaper = CompletionLogprobs(top, as_ids=read(body, RETURN_TOKENS_AS_TOKEN_IDS)) if logprobs is not None else None
        echoes = [await self.prompt_text(p) for p in prompts] if echo else None
        prompts = [{**p, **truncated} for p in prompts]
        shape = CompletionShape(self.pipeline.new_rid(), lora or self.model_name, shaper, echoes)
        shape.extras = Extras(prompt_top, read(body, RETURN_TOKEN_IDS))
        shape.lora = lora
        # As vLLM: max_tokens 0 only with echo, which returns the prompt alone (with its logprobs
        # when asked, lm-eval's way to score a prompt); the request samples nothing.
        max_tokens = read(body, replace(COMPLETION_MAX_TOKENS, minimum=0 if echo else 1))
        return await self._respond(request, body, COMPLETIONS, max_tokens, returns, prompts, shape)

    async def prompt_text(self, prompt: dict) -> str:
        if "text" in prompt:
            return prompt["text"]
        return await self.pipeline.detokenize(prompt["input_ids"], skip_special_tokens=False)

    async def _respond(self, request: Request, body: dict, where: str, max_tokens: int | None, returns: Returns, prompts: list[dict],
                       shape: Shape, max_tokens_name: str = "max_tokens") -> Response:
        """One request of `where`'s body (gateway/fields.py), whatever its prompts and choices."""
        returns = routed_experts_returns(body, returns)
        returns = replace(returns, prompt_ids=shape.extras.token_ids)
        if returns.routed_experts:
            shape.experts = (returns.routed_experts_start_len, await self.pipeline.routed_layout())
        sampling = sampling_params(body, max_tokens, returns, where=where, mode_default=self.logprobs_mode,
                                   max_tokens_name=max_tokens_name, constraint=openai_constraint(body), limits=self.limits)
        sampling = msgspec.structs.replace(shape.constrained(sampling, body), lora=shape.lora)
        n = choices_count(body, len(prompts))
        stream, include_usage = stream_flags(body)
        shape.continuous_usage = include_usage and continuous_usage(body)
        rids = [shape.rid] if len(prompts) * n == 1 else [f"{shape.rid}-{i}" for i in range(len(prompts) * n)]
        groups = [self.pipeline.metrics.group(n, sampling.max_new_tokens) for _ in prompts]
        streams = [self.pipeline.stream(rids[p * n + j], seeded(sampling, j), groups[p], **prompt, max_tokens_name=max_tokens_name)
                   for p, prompt in enumerate(prompts) for j in range(n)]
        shape.n = n
        if stream:
            firsts = await first_outputs(streams)  # a rejection becomes an HTTP error, not a 200 stream
            return sse_response(shape.chunks(merged(firsts, streams), len(streams), include_usage))
        results = await until_disconnect(request, gather_all(streams))
        return JSONResponse(shape.whole(results))


def completion_prompts(prompt: object) -> list[dict]:
    """`prompt` as a string, a list of strings, a list of token ids or a list of such lists."""

    def text(value: str, name: str) -> dict:
        if not value:
            raise empty_prompt(name)
        return {"text": value}

    if isinstance(prompt, str):
        return [text(prompt, "prompt")]
    if prompt == []:
        raise empty_prompt("prompt")
    if not isinstance(prompt, list):
        raise invalid("'prompt' must be a non-empty string, list of strings, list of token ids, or list of such lists", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return [text(p, "prompt") for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [{"input_ids": token_ids(p, "prompt")} for p in prompt]
    return [{"input_ids": token_ids(prompt, "prompt")}]


@dataclass(frozen=True)
class Extras:
    """vLLM's additions to OpenAI's shapes that a request asked for."""

    prompt_logprobs: int | None = None  # alternatives per prompt position; None: no prompt_logprobs
    token_ids: bool = False  # return_token_ids: each choice's token_ids and the prompt's prompt_token_ids

    def prompt_fields(self, result: Result) -> dict:
        """`prompt_token_ids` and `prompt_logprobs` (null unless asked: vLLM always has the keys)."""
        return {"prompt_token_ids": result.prompt_token_ids if self.token_ids else None,
                "prompt_logprobs": None if self.prompt_logprobs is None else vllm_prompt_logprobs(result, self.prompt_logprobs)}

    def streamed_prompt_fields(self, out: protocol.RequestOutput) -> dict:
        """The asked ones only, for a choice's first chunk (later chunks have no such key)."""
        fields = {}
        if self.token_ids:
            fields["prompt_token_ids"] = list(out.prompt_token_ids)
        if self.prompt_logprobs is not None:
            fields["prompt_logprobs"] = vllm_prompt_logprobs(_as_result(out), self.prompt_logprobs)
        return fields


class Shape:
    """The envelope OpenAI puts around choices, for one response or stream."""

    id_prefix = chunk_object = whole_object = ""

    def __init__(self, rid: str, model: str) -> None:
        self.rid = rid
        self.id, self.model, self.created = f"{self.id_prefix}-{rid}", model, int(time.time())
        self.n = 1  # samples per prompt
        self.experts: tuple[int, tuple[int, int]] | None = None  # routed experts asked: (start_len, (layers, k))
        self.extras = Extras()
        self.continuous_usage = False  # usage so far in every chunk (vLLM's continuous_usage_stats)
        self.lora = ""  # the LoRA adapter it runs under ("": the base model)

    def _envelope(self, obj: str, choices: list, usage_: dict | None) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, "usage": usage_}

    def _chunk(self, choices: list, usage_: dict | None = None, version: str = "", sglext: dict | None = None,
               top: dict | None = None) -> str:
        chunk = self._envelope(self.chunk_object, choices, usage_)
        chunk.update(top or {})
        if version:  # a chunk with tokens: the weights that computed them
            chunk["metadata"] = {"weight_version": version}
        if sglext is not None:  # the routed experts of the choice this chunk ends
            chunk["sglext"] = sglext
        return json.dumps(chunk)

    def usage_of(self, prompt_tokens: list[int], completion_tokens: list[int], cached_tokens: list[int]) -> dict:
        """Each prompt's tokens once, whatever its number of samples; of them, those read from the
        prefix cache by the sample that read the most."""
        n = self.n
        cached = sum(max(cached_tokens[p : p + n]) for p in range(0, len(cached_tokens), n))
        return usage(sum(prompt_tokens[::n]), sum(completion_tokens), cached)

    def whole(self, results: list[Result]) -> dict:
        choices = [self.choice(i, r) for i, r in enumerate(results)]
        whole = self._envelope(self.whole_object, choices, self.usage_of([r.prompt_tokens for r in results],
                                                                          [r.completion_tokens for r in results],
                                                                          [r.cached_tokens for r in results]))
        # An extension, as SGLang's: the weights that computed the tokens (the latest, if an update came between)
        if version := next((r.weight_spans[-1][0] for r in reversed(results) if r.weight_spans), None):
            whole["metadata"] = {"weight_version": version}
        if self.experts is not None:  # SGLang's extension object: the response's, or each choice's (gateway/experts.py)
            for holder, result in zip([whole] if len(results) == 1 else choices, results):
                holder["sglext"] = routed_fields(result.routed_experts, *self.experts)
        return whole

    async def chunks(self, outputs: AsyncIterator[tuple[int, protocol.RequestOutput]], count: int, include_usage: bool) -> AsyncIterator[str]:
        prompt_tokens, completion_tokens, cached_tokens = [0] * count, [0] * count, [0] * count
        try:
            async for index, out in outputs:
                before = completion_tokens[index]
                prompt_tokens[index] = out.prompt_tokens or prompt_tokens[index]
                completion_tokens[index] = out.completion_tokens or completion_tokens[index]
                cached_tokens[index] = out.cached_tokens or cached_tokens[index]
                opening = self.opening_fields(index, out)  # before opening(), which marks the choice started
                for choice, tokens_so_far in [(c, before) for c in self.opening(index)] + \
                                             [(c, completion_tokens[index]) for c in self.delta(index, out)]:
                    last = self.experts is not None and choice["finish_reason"] is not None  # the choice's last chunk
                    so_far = continued_usage(prompt_tokens[index], tokens_so_far) if self.continuous_usage else None
                    yield self._chunk([choice], so_far, version=out.weight_version,
                                      sglext=routed_fields(out.routed_experts, *self.experts) if last else None, top=opening)
                    opening = None
        finally:
            await outputs.aclose()
        if include_usage:
            yield self._chunk([], self.usage_of(prompt_tokens, completion_tokens, cached_tokens))

    def opening_fields(self, index: int, out: protocol.RequestOutput) -> dict:
        """Envelope fields of the first chunk this output makes (chat's prompt fields open a choice)."""
        return {}

    def opening(self, index: int) -> list[dict]:
        """The chunks that open a choice before its first output's (chat's role), once per choice;
        they count none of its tokens."""
        return []

    def constrained(self, sampling: protocol.SamplingParams, body: dict) -> protocol.SamplingParams:
        """The request's sampling with what the response's shape asks of the output (chat's forced tool call)."""
        return sampling

    def choice(self, index: int, result: Result) -> dict:
        raise NotImplementedError

    def delta(self, index: int, out: protocol.RequestOutput) -> list[dict]:
        raise NotImplementedError


class ChatShape(Shape):
    id_prefix, chunk_object, whole_object = "chatcmpl", "chat.completion.chunk", "chat.completion"

    def __init__(self, rid: str, model: str, logprobs: ChatLogprobs | None, tools: ToolUse = ToolUse(), thinks: bool = False,
                 reasons: bool = False, channels: bool = False) -> None:
        super().__init__(rid, model)
        self.logprobs = logprobs
        self.started: set[int] = set()
        self.echo = ""  # vLLM's echo of a continued assistant message: its given part, before the output
        self.tools = tools
        self.thinks = thinks  # the output is read for thinking (gateway/reasoning.py)
        self.reasons = reasons  # the whole message has reasoning fields (vLLM's, with a reasoning parser: null when none)
        # a Harmony model: the output is read by its channels (gateway/harmony.py), but a named call's,
        # whose header the prompt holds: its text is the arguments
        self.channels = channels and tools.choice != "named"
        self.readers: dict[int, Reading | HarmonyReading] = {}  # each streamed choice's reader of thinking and tool calls

    def constrained(self, sampling: protocol.SamplingParams, body: dict) -> protocol.SamplingParams:
        sampling = self.tools.constrained(sampling, body)
        self.thinks = self.thinks and sampling.constraint is None  # a constrained output is all answer
        if self.channels:
            if sampling.constraint is not None:  # it would hold from the first token, where Harmony writes a header
                field = next((name for name in CONSTRAINT_FIELDS if body.get(name) not in (None, {"type": "text"})), "response_format")
                raise invalid(f"'{field}' constrains the output, which a Harmony model (GPT-OSS) writes in channels: "
                              "constrained decoding of its answer is not served yet", field)
            sampling = msgspec.structs.replace(sampling, channels=True)
        return sampling

    def reading(self) -> Reading | HarmonyReading:
        if self.channels:
            return HarmonyReading(calls=self.tools.choice == "auto", single=not self.tools.parallel)
        return Reading(Thinking() if self.thinks else None, self.tools.reader())

    def read(self, source: Result | protocol.RequestOutput) -> str | Sequence[protocol.ChannelText]:
        """What a reader reads of an output: its channels (a Harmony model), or its text."""
        return source.channels if self.channels else source.text

    def whole(self, results: list[Result]) -> dict:
        whole = super().whole(results)
        whole.update(self.extras.prompt_fields(results[0]))  # one prompt: its fields once, at the top, as vLLM
        return whole

    def opening_fields(self, index: int, out: protocol.RequestOutput) -> dict:
        return self.extras.streamed_prompt_fields(out) if index not in self.started else {}  # vLLM's, at the top

    def choice(self, index: int, result: Result) -> dict:
        message, called = self.reading().whole(self.read(result))
        if self.reasons:
            message = {"reasoning": None, "reasoning_content": None} | message
        if self.echo:
            message["content"] = self.echo + (message["content"] or "")
        return {"index": index, "message": {"role": "assistant", **message},
                "logprobs": self.logprobs.of(result) if self.logprobs else None,
                "finish_reason": self.tools.finish_reason(result.finish, called),
                "matched_stop": result.finish.matched if result.finish else None,
                "token_ids": result.token_ids if self.extras.token_ids else None}

    def opening(self, index: int) -> list[dict]:
        if index in self.started:
            return []
        self.started.add(index)  # each choice opens with the role, as OpenAI and SGLang do
        choices = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        if self.echo:
            choices.append({"index": index, "delta": {"content": self.echo}, "logprobs": None, "finish_reason": None})
        return choices

    def delta(self, index: int, out: protocol.RequestOutput) -> list[dict]:
        choices = []
        ids = {"token_ids": list(out.token_ids)} if self.extras.token_ids else {}
        if index not in self.readers:
            self.readers[index] = self.reading()
        reader = self.readers[index]
        if reader.plain:
            parts = [{"content": out.text}] if out.text or out.token_ids else []
        else:  # thinking, content and tool calls as the readers find them; an output held back still brings its tokens' fields
            parts = reader.deltas(self.read(out), out.finish is not None) or ([{}] if out.token_ids and (self.logprobs or ids) else [])
        logprobs = self.logprobs.of(_as_result(out)) if self.logprobs and out.token_ids else None
        for k, part in enumerate(parts):  # the output's tokens go with its first part
            choices.append({"index": index, "delta": part, "logprobs": logprobs if k == 0 else None, "finish_reason": None,
                            **(ids if k == 0 else {})})
        if out.finish is not None:  # with the output's last part, as vLLM's (serving_chat.py, the stream generator)
            if not choices:
                choices.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": None})
            choices[-1]["finish_reason"] = self.tools.finish_reason(out.finish, reader.called)
        return choices


class CompletionShape(Shape):
    id_prefix, chunk_object, whole_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, rid: str, model: str, logprobs: CompletionLogprobs | None, echoes: list[str] | None) -> None:
        super().__init__(rid, model)
        self.logprobs = logprobs
        self.echoes = echoes  # each prompt's text, when the client asked for echo
        self.offsets: dict[int, int] = {}  # streamed choices' next text_offset

    def _echo(self, index: int) -> str:
        return self.echoes[index // self.n] if self.echoes else ""

    def choice(self, index: int, result: Result) -> dict:
        echo = self._echo(index)
        logprobs = self.logprobs.of(result, 0, with_prompt=bool(echo))[0] if self.logprobs else None
        return {"index": index, "text": echo + result.text, "logprobs": logprobs, "finish_reason": finish_reason(result.finish),
                "matched_stop": result.finish.matched if result.finish else None,
                "token_ids": result.token_ids if self.extras.token_ids else None, **self.extras.prompt_fields(result)}

    def delta(self, index: int, out: protocol.RequestOutput) -> list[dict]:
        offset = self.offsets.get(index)
        first = offset is None
        echo = self._echo(index) if first else ""
        logprobs, self.offsets[index] = None, 0
        if self.logprobs:
            logprobs, self.offsets[index] = self.logprobs.of(_as_result(out), offset or 0, with_prompt=bool(echo))
        prompt_fields = self.extras.streamed_prompt_fields(out) if first else {}  # vLLM's, on a choice's first chunk
        if not (echo or prompt_fields or out.text or out.token_ids or out.finish is not None):
            return []
        choice = {"index": index, "text": echo + out.text, "logprobs": logprobs, "finish_reason": finish_reason(out.finish)}
        if self.extras.token_ids:
            choice["token_ids"] = list(out.token_ids)
        return [{**choice, **prompt_fields}]


def _as_result(out: protocol.RequestOutput) -> Result:
    result = Result()
    result.add(out)
    return result
