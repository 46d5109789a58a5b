"""`GET /openapi.json`: the gateway's routes as an OpenAPI 3.1 document, for clients and fuzzers.

1. OPERATIONS holds, per path, what only a person can say: a summary, the JSON body's main fields
   and their kinds, the query parameters, the statuses beyond the common ones.
2. `document` walks the app's own route table (gateway/app.py) for the rest: each path's methods,
   and its key class (gateway/auth.py), which with the keys configured says whether the route wants
   a key (`security`) and can answer 401. A route with no entry in OPERATIONS fails `build_app`,
   and an entry with no route fails a test: the document cannot drift from what is served.
Bodies name the fields the gateway reads with their kinds (ranges where a field has a fixed one);
`additionalProperties` stays open, as the gateway ignores fields it does not know (vLLM's rule:
the peers' clients send their own extensions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import version

from starlette.routing import Route

from gateway.auth import Access, accepted
from jaxstream.config import LOGPROBS_MODES
from jaxstream.keys import Keys
from jaxstream.protocol import LOAD_FORMATS, MAX_TOP_LOGPROBS, MEMORY_TAGS, PAUSE_MODES

# -- JSON Schema pieces

STR, INT, NUM, BOOL, OBJ = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "object"}
IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}  # token ids
STRS = {"type": "array", "items": STR}


def one_of(*schemas: dict) -> dict:
    return {"oneOf": list(schemas)}


def enum(values) -> dict:
    return {"type": "string", "enum": list(values)}


def body(required: tuple[str, ...] = (), **properties: dict) -> dict:
    schema = {"type": "object", "properties": properties, "additionalProperties": True}
    if required:
        schema["required"] = list(required)
    return schema


STOP = one_of(STR, STRS)
TOP = {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}
# The sampling fields OpenAI's routes read at the top level and /generate inside sampling_params (gateway/params.py)
SAMPLING = {
    "temperature": {"type": "number", "minimum": 0}, "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": INT, "min_p": {"type": "number", "minimum": 0, "maximum": 1}, "seed": INT,
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
    "stop": STOP, "stop_regex": STOP, "stop_token_ids": IDS, "ignore_eos": BOOL, "skip_special_tokens": BOOL,
    "logit_bias": {"type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "allowed_token_ids": IDS, "logprobs_mode": enum(LOGPROBS_MODES), "n": {"type": "integer", "minimum": 1},
    "no_stop_trim": BOOL, "include_stop_str_in_output": BOOL,
}
OPENAI_SAMPLING = {
    **SAMPLING, "model": STR, "min_tokens": {"type": "integer", "minimum": 0}, "stream": BOOL,
    "stream_options": body(include_usage=BOOL, continuous_usage_stats=BOOL),
    "response_format": OBJ, "structured_outputs": OBJ, "guided_json": one_of(STR, OBJ), "guided_regex": STR,
    "guided_choice": STRS, "guided_grammar": STR, "prompt_logprobs": TOP, "return_token_ids": BOOL,
    "return_tokens_as_token_ids": BOOL, "return_routed_experts": BOOL, "routed_experts_start_len": {"type": "integer", "minimum": 0},
    "truncate_prompt_tokens": INT, "truncation_side": enum(("left", "right")),
}
TEXT_PART = body(("type", "text"), type={"const": "text"}, text=STR)
MESSAGE = body(("role",), role=enum(("system", "user", "assistant", "developer", "tool")),
               content=one_of(STR, {"type": "array", "items": TEXT_PART}, {"type": "null"}),
               tool_calls={"type": "array", "items": OBJ}, tool_call_id=STR, name=STR)
MESSAGES = {"type": "array", "items": MESSAGE, "minItems": 1}
TOOLS = {"tools": {"type": "array", "items": OBJ}, "tool_choice": one_of(STR, OBJ), "parallel_tool_calls": BOOL}
CHAT_TEMPLATE = {"add_generation_prompt": BOOL, "continue_final_message": BOOL}
UPDATE = {"weight_version": STR, "flush_cache": BOOL}

CHAT = body(("messages",), messages=MESSAGES, max_tokens={"type": "integer", "minimum": 1},
            max_completion_tokens={"type": "integer", "minimum": 1}, logprobs=BOOL, top_logprobs=TOP, echo=BOOL,
            **TOOLS, **CHAT_TEMPLATE, **OPENAI_SAMPLING)
COMPLETION = body(("prompt",), prompt=one_of(STR, STRS, IDS, {"type": "array", "items": IDS}),
                  max_tokens={"type": "integer", "minimum": 0}, logprobs=TOP, echo=BOOL, **OPENAI_SAMPLING)
RESPONSE = body(("input",), input=one_of(STR, {"type": "array", "items": body(
                    ("role", "content"), type={"const": "message"}, role=enum(("user", "system", "developer", "assistant")),
                    content=one_of(STR, {"type": "array", "items": body(("type", "text"), type=enum(("input_text", "output_text")),
                                                                         text=STR)}))}),
                instructions=STR, previous_response_id=STR, model=STR, max_output_tokens={"type": "integer", "minimum": 1},
                temperature=SAMPLING["temperature"], top_p=SAMPLING["top_p"], top_logprobs=TOP, include=STRS, store=BOOL,
                stream=BOOL, metadata={"type": "object", "additionalProperties": STR}, text=body(format=OBJ), user=STR,
                tool_choice=STR, parallel_tool_calls=BOOL)
GENERATE_SAMPLING = body(max_new_tokens={"type": "integer", "minimum": 0}, min_new_tokens={"type": "integer", "minimum": 0},
                         sampling_seed=INT, json_schema=STR, regex=STR, ebnf=STR, **SAMPLING)
GENERATE = body(text=one_of(STR, STRS), input_ids=one_of(IDS, {"type": "array", "items": IDS}),
                sampling_params=one_of(GENERATE_SAMPLING, {"type": "array", "items": GENERATE_SAMPLING}),
                rid=one_of(STR, STRS), stream=BOOL, return_logprob=BOOL, top_logprobs_num=TOP,
                logprob_start_len={"type": "integer", "minimum": -1}, return_text_in_logprobs=BOOL, token_ids_logprob=IDS,
                logprobs_mode=enum(LOGPROBS_MODES), return_routed_experts=BOOL,
                routed_experts_start_len={"type": "integer", "minimum": 0})
SCORE = body(("query", "items", "label_token_ids"), query=one_of(STR, IDS), items=one_of(STR, STRS, {"type": "array", "items": IDS}),
             label_token_ids=IDS, apply_softmax=BOOL, item_first=BOOL, model=STR)
TOKENIZE = body(prompt=one_of(STR, STRS), messages=MESSAGES, add_special_tokens=BOOL, return_token_strs=BOOL,
                **CHAT_TEMPLATE, tools=TOOLS["tools"])
DETOKENIZE = body(("tokens",), tokens=one_of(IDS, {"type": "array", "items": IDS}), skip_special_tokens=BOOL)
TAGS = body(tags={"type": "array", "items": enum(MEMORY_TAGS), "minItems": 1})
ERROR = body(("error",), error=body(("message", "type"), message=STR, type=STR, param={"type": ["string", "null"]},
                                    code={"type": ["string", "null"]}))


# -- each path's operation

@dataclass(frozen=True)
class Operation:
    summary: str
    body: dict | None = None  # the JSON request body's schema; None: the route reads no body
    body_optional: bool = False  # control routes: `{}`, no body at all, or a GET
    query: dict[str, dict] = field(default_factory=dict)  # name: schema
    statuses: tuple[int, ...] = ()  # beyond 200, 400 (with a body or query) and 401 (where a key is wanted)
    produces: str = "application/json"
    streams: bool = False  # `stream: true` answers server-sent events
    raw_body: bool = False  # also takes the bytes themselves (application/octet-stream)
    own_errors: bool = False  # its non-200 answers are its own JSON, not OpenAI's error shape


GENERATION = (404, 413, 503)
OPERATIONS = {
    "/v1/chat/completions": Operation("OpenAI chat completion", CHAT, statuses=GENERATION, streams=True),
    "/v1/completions": Operation("OpenAI completion (text or token ids, one prompt or several)", COMPLETION, statuses=GENERATION,
                                 streams=True),
    "/v1/responses": Operation("OpenAI Responses API, as one chat completion", RESPONSE, statuses=GENERATION, streams=True),
    "/v1/models": Operation("The served model's card", statuses=(503,)),
    "/v1/models/{model}": Operation("One model's card; 404 for any other name", statuses=(404, 503)),
    "/generate": Operation("SGLang's native generation (text or input_ids, batches, n samples)", GENERATE, statuses=(413, 503),
                           streams=True),
    "/v1/score": Operation("SGLang's scoring: the probability of each label token after query + item", SCORE, statuses=(413, 503)),
    "/health": Operation("200 when every service has a live instance, else 503 naming the missing ones", statuses=(503,),
                         own_errors=True),
    "/health_generate": Operation("200 when a one-token generation comes back in time", statuses=(503,), produces=""),
    "/stats": Operation("Each live service instance's stats by role", statuses=(503,)),
    "/metrics": Operation("Prometheus metrics", statuses=(503,), produces="text/plain"),
    "/openapi.json": Operation("This document"),
    "/version": Operation("The server's version"),
    "/abort_request": Operation("Abort a request by rid, or every request", body(rid=STR, abort_all=BOOL), statuses=(413, 503),
                                produces=""),
    "/flush_cache": Operation("Empty the prefix cache when no request runs; 400 naming what runs",
                              query={"timeout": {"type": "number", "minimum": 0, "maximum": 600}}, statuses=(503,),
                              produces="text/plain"),
    "/v1/loads": Operation("SGLang's load report, one entry per scheduler", statuses=(503,)),
    "/get_model_info": Operation("SGLang's model info", statuses=(503,)),
    "/model_info": Operation("SGLang's model info", statuses=(503,)),
    "/get_server_info": Operation("SGLang's server info (the config, secrets masked)", statuses=(503,)),
    "/server_info": Operation("SGLang's server info (the config, secrets masked)", statuses=(503,)),
    "/get_weight_version": Operation("The served weights' version", statuses=(503,)),
    "/weight_version": Operation("The served weights' version", statuses=(503,)),
    "/pause_generation": Operation("Pause every replica (new requests wait)", body(mode=enum(PAUSE_MODES)), statuses=(413, 503)),
    "/continue_generation": Operation("Continue after a pause", body(), body_optional=True, statuses=(413, 503)),
    "/update_weights_from_disk": Operation(
        "Load new weights from a checkpoint on every replica, then swap",
        body(("model_path",), model_path=STR, load_format=enum(LOAD_FORMATS), abort_all_requests=BOOL, **UPDATE),
        statuses=(413, 500, 503)),
    "/update_weights_from_tensor": Operation(
        "Stage one bucket of tensors as safetensors bytes (JSON: base64 buffers; else the raw bytes, fields in the query)",
        body(("serialized_named_tensors",), serialized_named_tensors={"type": "array", "items": STR, "minItems": 1},
             load_format={"const": "safetensors"}, last_bucket=BOOL, **UPDATE),
        query={"last_bucket": BOOL, **UPDATE}, statuses=(413, 500, 503), raw_body=True),
    "/update_weight_version": Operation("Set the weights' version name", body(("new_version",), new_version=STR, abort_all_requests=BOOL),
                                        statuses=(413, 500, 503)),
    "/list_weights": Operation("Every checkpoint tensor the model reads", query={"prefix": STR}, statuses=(503,)),
    "/release_memory_occupation": Operation("Release the workers' device memory (weights, KV cache)", TAGS, body_optional=True,
                                            statuses=(413, 503)),
    "/resume_memory_occupation": Operation("Take the released device memory back", TAGS, body_optional=True, statuses=(413, 503)),
    "/tokenize": Operation("Text or chat messages to token ids", TOKENIZE, statuses=(413, 503)),
    "/v1/tokenize": Operation("Text or chat messages to token ids", TOKENIZE, statuses=(413, 503)),
    "/detokenize": Operation("Token ids to text", DETOKENIZE, statuses=(413, 503)),
    "/v1/detokenize": Operation("Token ids to text", DETOKENIZE, statuses=(413, 503)),
}
REASONS = {200: "OK", 400: "A bad request, naming the field", 401: "No key, or a wrong one",
           404: "No such model", 413: "The body is over the server's size limit", 500: "Replicas failed to apply an update",
           503: "A service the route needs is unavailable (Retry-After)"}
SECURITY_SCHEMES = {"bearer": {"type": "http", "scheme": "bearer", "description": "OpenAI's Authorization: Bearer <key>"},
                    "apiKeyHeader": {"type": "apiKey", "in": "header", "name": "x-api-key"}}


def openapi_path(route: Route) -> str:
    """Starlette's `{model:path}` as OpenAPI's `{model}`."""
    return route.path.replace(":path}", "}")


def document(routes: list, keys: Keys) -> dict:
    """The OpenAPI document of `routes` (build_app's), as served with `keys`. KeyError names a
    route with no entry in OPERATIONS."""
    paths = {}
    for route in routes:
        path = openapi_path(route)
        if path not in OPERATIONS:
            raise KeyError(f"{path} has no entry in gateway/openapi.py OPERATIONS: describe it there")
        guarded = bool(accepted(route.endpoint.access, keys))
        methods = sorted(route.methods - {"HEAD"})  # Starlette adds HEAD to every GET
        paths[path] = {method.lower(): operation(OPERATIONS[path], path, method, guarded) for method in methods}
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxstream gateway", "version": version("jaxstream"),
                 "description": "OpenAI's, vLLM's and SGLang's HTTP surface over jaxstream's pipeline. Errors come in "
                                "OpenAI's shape; unknown body fields are ignored."},
        "paths": paths,
        "components": {"securitySchemes": SECURITY_SCHEMES, "schemas": {"Error": ERROR}},
    }


def operation(op: Operation, path: str, method: str, guarded: bool) -> dict:
    out: dict = {"summary": op.summary, "operationId": f"{method.lower()}{path.replace('/', '_').replace('{', '').replace('}', '')}"}
    parameters = [{"name": name, "in": "query", "required": False, "schema": schema} for name, schema in op.query.items()]
    if "{model}" in path:
        parameters.insert(0, {"name": "model", "in": "path", "required": True, "schema": STR})
    if parameters:
        out["parameters"] = parameters
    statuses = {200, *op.statuses}
    if op.body is not None and method != "GET":
        content = {"application/json": {"schema": op.body}}
        if op.raw_body:
            content["application/octet-stream"] = {"schema": {"type": "string", "format": "binary"}}
        out["requestBody"] = {"required": not op.body_optional, "content": content}
    if op.body is not None or op.query:
        statuses.add(400)
    if guarded:
        statuses.add(401)
    out["security"] = [{"bearer": []}, {"apiKeyHeader": []}] if guarded else []
    out["responses"] = {str(status): response(op, status) for status in sorted(statuses)}
    return out


def response(op: Operation, status: int) -> dict:
    if status != 200 and op.own_errors:
        return {"description": REASONS[status], "content": {"application/json": {"schema": {}}}}
    if status != 200:
        return {"description": REASONS[status], "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    content = {}
    if op.produces == "application/json":
        content["application/json"] = {"schema": {}}  # JSON of the route's own shape (OpenAI's, SGLang's)
    elif op.produces:
        content[op.produces] = {"schema": STR}
    if op.streams:
        content["text/event-stream"] = {"schema": STR}
    return {"description": REASONS[200], **({"content": content} if content else {})}
