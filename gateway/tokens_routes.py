"""vLLM's tokens in, tokens out route, `POST /inference/v1/generate` (its serve/disagg router, and
ServingTokens): SkyRL's rollouts run through it (RemoteInferenceClient.generate and .sample).

Takes `token_ids` (the prompt), `sampling_params` (vLLM's SamplingParams: `max_tokens` (16), `n`,
`logprobs` (alternatives per token; 0: the sampled token's logprob alone), `prompt_logprobs`, vLLM's
`structured_outputs`, and the sampling fields under vLLM's rules: `ignore_eos` leaves the request's
`stop_token_ids` in force), `model`, `request_id`. Answers the whole output whatever `stream` says,
as vLLM does: `{"request_id", "choices": [{"index", "logprobs", "finish_reason", "token_ids"}],
"prompt_logprobs", "kv_transfer_params": null}`, each choice's logprobs as chat's with tokens named
`token_id:<id>`; and, as the OpenAI routes, `metadata.weight_version`.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.constraints import only_one, vllm_fields
from gateway.fanout import gather_all
from gateway.fields import INFERENCE_LOGPROBS, INFERENCE_MAX_TOKENS, INFERENCE_SAMPLING
from gateway.generation import Result
from gateway.http import read_body, until_disconnect
from gateway.logprobs import ChatLogprobs, vllm_prompt_logprobs
from gateway.openai_routes import OpenAIRoutes
from gateway.params import (
    Returns, check, choices_count, get, prompt_logprobs_count, read, refuse_unsupported, sampling_params, seeded, token_ids,
)

PREFIX = "sampling_params."


class TokensRoutes:
    def __init__(self, openai: OpenAIRoutes) -> None:
        self.openai = openai  # the model's name, the server's logprobs mode and limits
        self.pipeline = openai.pipeline

    async def generate(self, request: Request) -> Response:
        body = await read_body(request)
        lora = await self.openai.check_model(body)
        refuse_unsupported(body)
        check(body.get("features") is None, "features", "(multimodal input) is not supported by this server yet")
        prompt = token_ids(body.get("token_ids"), "token_ids")
        params = get(body, "sampling_params", dict, {})
        refuse_unsupported(params, prefix=PREFIX)
        logprobs = await self.openai.logprob_counts(read(params, INFERENCE_LOGPROBS, prefix=PREFIX), PREFIX + "logprobs")
        prompt_top = await self.openai.logprob_counts(prompt_logprobs_count(params), PREFIX + "prompt_logprobs", "prompt")
        returns = Returns(top_logprobs=logprobs or 0, prompt_logprobs_from=-1 if prompt_top is None else 0,
                          texts=prompt_top is not None,  # decoded_token; output tokens are named by id
                          prompt_top_logprobs=-1 if prompt_top is None else prompt_top)
        sampling = sampling_params(params, read(params, INFERENCE_MAX_TOKENS, prefix=PREFIX), returns, where=INFERENCE_SAMPLING,
                                   mode_default=self.openai.logprobs_mode, prefix=PREFIX, max_tokens_name=PREFIX + "max_tokens",
                                   constraint=only_one(vllm_fields(params)), limits=self.openai.limits)
        sampling = msgspec.structs.replace(sampling, lora=lora)
        n = choices_count(params, 1, prefix=PREFIX)
        rid = get(body, "request_id", str, None) or self.pipeline.new_rid()
        rids = [rid] if n == 1 else [f"{rid}-{j}" for j in range(n)]
        group = self.pipeline.metrics.group(n, sampling.max_new_tokens)
        streams = [self.pipeline.stream(rids[j], seeded(sampling, j), group, input_ids=prompt, max_tokens_name=PREFIX + "max_tokens")
                   for j in range(n)]
        results = await until_disconnect(request, gather_all(streams))
        shaper = ChatLogprobs(as_ids=True) if logprobs is not None else None
        answer = {"request_id": rid, "choices": [choice(j, r, shaper) for j, r in enumerate(results)],
                  "prompt_logprobs": None if prompt_top is None else vllm_prompt_logprobs(results[0], prompt_top),
                  "kv_transfer_params": None}
        if version := next((r.weight_spans[-1][0] for r in reversed(results) if r.weight_spans), None):
            answer["metadata"] = {"weight_version": version}
        return JSONResponse(answer)


def choice(index: int, result: Result, logprobs: ChatLogprobs | None) -> dict:
    return {"index": index, "logprobs": logprobs.of(result) if logprobs else None,
            "finish_reason": result.finish.type if result.finish else "stop", "token_ids": result.token_ids}
