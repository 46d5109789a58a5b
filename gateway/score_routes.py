"""SGLang's `/v1/score`: how likely each label token is to come next, after a query and each item.

1. Read `query` (text or token ids), `items` (one text, a list of texts, or a list of token id
   lists: the query's kind), `label_token_ids`, `apply_softmax`, `item_first`, `model`.
2. Each item is one request in the pipeline: its prompt query + item (item + query with
   `item_first`; texts joined as strings, then tokenized, ids joined as lists, as SGLang does), one
   greedy token, asking `token_ids_logprob` = the labels under the raw distribution (the model's own
   logits, T = 1: `raw_logprobs`), so a label's score is exactly the logprob /generate reports for it
   as the prompt's next token.
3. The first generated position's label logprobs become probabilities: exp(logprob) each, or with
   `apply_softmax` a softmax over the labels alone (they sum to 1). `scores[i]` follows the order of
   `label_token_ids`, repeats included.
"""

from __future__ import annotations

import math

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.adapters import Adapters
from gateway.errors import ApiError
from gateway.fanout import gather_all
from gateway.fields import APPLY_SOFTMAX, ITEM_FIRST, MODEL
from gateway.generation import Pipeline, Result
from gateway.http import read_body, until_disconnect
from gateway.params import ID_RANGE, MAX_CHOICES, check, empty_prompt, is_token_id, read, token_ids_logprob
from jaxstream.protocol import SamplingParams

LABELS = "label_token_ids"


class ScoreRoutes:
    def __init__(self, pipeline: Pipeline, model_name: str, adapters: Adapters) -> None:
        self.pipeline = pipeline
        self.model_name = model_name
        self.adapters = adapters  # `model` may name a LoRA adapter, as on the OpenAI routes

    async def score(self, request: Request) -> Response:
        body = await read_body(request)
        check(body.get(LABELS) is not None, LABELS, "must be given: the token ids whose probabilities are scored")
        asked = token_ids_logprob(body, LABELS)  # a list of ids, repeats dropped
        check(bool(asked), LABELS, "must name at least one token id")
        labels = list(body[LABELS])
        prompts = item_prompts(body, read(body, ITEM_FIRST))
        softmax = read(body, APPLY_SOFTMAX)
        model = read(body, MODEL)
        # A loaded LoRA adapter's name scores under it; any other name is the base model, as SGLang's
        # /v1/score, which reads no `model`, and its clients, which send their checkpoint's path there
        lora = model if model not in (None, self.model_name, "default") and model in await self.adapters.loaded() else ""
        model = self.model_name if model is None else model
        sampling = SamplingParams(max_new_tokens=1, temperature=0.0, raw_logprobs=True, ignore_eos=True, token_ids_logprob=asked,
                                  lora=lora)
        streams = [self.pipeline.stream(self.pipeline.new_rid(), sampling, **prompt) for prompt in prompts]
        try:
            results = await until_disconnect(request, gather_all(streams))
        except ApiError as exc:  # the tokenizer's vocabulary check names the pipeline's field
            if exc.param == "token_ids_logprob":
                raise ApiError(exc.status, exc.message.replace("token_ids_logprob", LABELS), LABELS, exc.code) from None
            raise
        scores = [label_scores(label_logprobs(r), labels, softmax) for r in results]
        return JSONResponse({"scores": scores, "model": model, "usage": None, "object": "scoring"})


def item_prompts(body: dict, item_first: bool) -> list[dict]:
    """The prompt fields (`text` or `input_ids`) of each item joined with the query: texts as
    strings, ids as lists (SGLang's), both of one kind."""
    query, items = body.get("query"), body.get("items")
    check(query is not None, "query", "must be given: a string or a list of token ids")
    check(items is not None, "items", "must be given: a string, a list of strings or a list of token id lists")
    if isinstance(query, str):
        key, items = "text", [items] if isinstance(items, str) else items
        check(isinstance(items, list) and all(isinstance(t, str) for t in items), "items",
              "must be a string or a list of strings when 'query' is a string (query and items are both text or both token ids)")
    else:
        key = "input_ids"
        check(isinstance(query, list) and all(map(is_token_id, query)), "query", f"must be a string or a list of token ids ({ID_RANGE})")
        check(isinstance(items, list) and all(isinstance(i, list) for i in items), "items",
              "must be a list of token id lists when 'query' is token ids (query and items are both text or both token ids)")
        for i, item in enumerate(items):
            check(all(map(is_token_id, item)), f"items[{i}]", f"must be a list of token ids ({ID_RANGE})")
    check(bool(items), "items", "must not be empty")
    check(len(items) <= MAX_CHOICES, "items", f"must hold at most {MAX_CHOICES} items, got {len(items)}")
    joined = [item + query if item_first else query + item for item in items]
    if not all(joined):
        raise empty_prompt("items")
    return [{key: p if key == "text" else tuple(p)} for p in joined]


def label_logprobs(result: Result) -> dict[int, float]:
    """{label id: its logprob as the prompt's next token}, from the first generated position."""
    if not result.token_ids_logprobs:
        raise ApiError(500, "a scoring request ended without its first position's label logprobs")
    return {t.token_id: t.logprob for t in result.token_ids_logprobs[0]}


def label_scores(logprobs: dict[int, float], labels: list[int], softmax: bool) -> list[float]:
    """Probabilities in the order of `labels`: exp(logprob), or a softmax over the labels' logprobs."""
    values = [logprobs[label] for label in labels]
    if not softmax:
        return [math.exp(v) for v in values]
    peak = max(values)
    if peak == -math.inf:  # every label cut off: nothing to normalize
        return [0.0] * len(values)
    weights = [math.exp(v - peak) for v in values]
    total = sum(weights)
    return [w / total for w in weights]
