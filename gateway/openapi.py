"""`GET /openapi.json`: the gateway's routes as an OpenAPI 3.1 document, for clients and fuzzers.

1. OPERATIONS holds, per path, what only a person can say: a summary, the JSON body, the query
   parameters, the statuses beyond the common ones. A body that reads request fields is built
   from the table the gateway reads them with (gateway/fields.py): every field its route reads,
   under each spelling, with its kinds, range or choices, default and description; the control
   routes' few fields are written here.
2. `document` walks the app's own route table (gateway/app.py) for the rest: each path's methods,
   and its key class (gateway/auth.py), which with the keys configured says whether the route wants
   a key (`security`) and can answer 401. A route with no entry in OPERATIONS fails `build_app`,
   and an entry with no route fails a test: the document cannot drift from what is served.
A body's `additionalProperties` stays open, as the gateway ignores fields it does not know (vLLM's rule:
the peers' clients send their own extensions).
"""

from __future__ import annotations

import re

from dataclasses import dataclass, field
from importlib.metadata import version

from starlette.routing import Route

from gateway import fields
from gateway.auth import accepted
from gateway.fields import ABORT, CHAT, COMPLETIONS, DETOKENIZE, GENERATE, INFERENCE, RESPONSES, SCORE, STR, TOKENIZE, Field, obj
from jaxstream.keys import Keys
from jaxstream.protocol import GROUP_BACKENDS, LOAD_FORMATS, MEMORY_TAGS, PAUSE_MODES, WIRE_DTYPES

# -- JSON Schema pieces

BOOL = {"type": "boolean"}
JSON_TYPES = {float: "number", int: "integer", bool: "boolean", str: "string", list: "array", dict: "object"}


def enum(values) -> dict:
    return {"type": "string", "enum": list(values)}


def body_of(where: str) -> dict:
    """The schema of a body of kind `where` (gateway/fields.py): every row of the table it carries,
    under each of the row's spellings."""
    rows = [row for row in fields.FIELDS if where in row.bodies]
    properties = {}
    for row in rows:
        properties[row.name] = schema(row)
        for alias in row.aliases:
            properties[alias] = {**schema(row), "description": f"Another engine's spelling of '{row.name}', read after it"}
    return obj(tuple(row.name for row in rows if where in row.required_in), **properties)


def schema(row: Field) -> dict:
    """A row's JSON Schema: its shape where it has one, else its kinds with their range or choices."""
    kinds = [kind_schema(row, kind) for kind in row.kind]
    out = dict(row.shape) if row.shape is not None else kinds[0] if len(kinds) == 1 else {"oneOf": kinds}
    out["description"] = row.says
    if isinstance(row.default, (bool, int, float, str)):
        out["default"] = row.default
    return out


def kind_schema(row: Field, kind: type) -> dict:
    """One of a row's kinds; an array's items and an object's values are the row's `items` (or the
    rows of the body it `holds`), its range theirs."""
    if kind not in (list, dict):
        return scalar(row, kind)
    if row.holds and kind is dict:
        return body_of(row.holds)
    out: dict = {"type": JSON_TYPES[kind]}
    inner = body_of(row.holds) if row.holds else one_or_many([scalar(row, item) for item in row.items])
    if inner:
        out["items" if kind is list else "additionalProperties"] = inner
    if row.max_items is not None:
        out["maxItems" if kind is list else "maxProperties"] = row.max_items
    return out


def scalar(row: Field, kind: type) -> dict:
    out = {"type": JSON_TYPES[kind]}
    if kind in (int, float):
        out.update(bounds(row))
    if kind is str and row.choices:
        out["enum"] = list(row.choices)
    return out


def bounds(row: Field) -> dict:
    """The range of a row's numbers, with the value outside it that it takes too (top_k's -1)."""
    span = {}
    if row.minimum is not None:
        span["exclusiveMinimum" if row.open_minimum else "minimum"] = row.minimum
    if row.maximum is not None:
        span["maximum"] = row.maximum
    if row.sentinel is None:
        return span
    value = row.sentinel[0]
    if span.get("minimum") == value + 1:  # next to the range: one range
        return {**span, "minimum": value}
    return {"anyOf": [{"const": value}, span]}


def one_or_many(schemas: list[dict]) -> dict | None:
    return None if not schemas else schemas[0] if len(schemas) == 1 else {"oneOf": schemas}


UPDATE = {"weight_version": STR, "flush_cache": BOOL}
VLLM_PAUSE = {"mode": enum(("abort", "wait", "keep")), "clear_cache": BOOL, "wait_for_inflight_requests": BOOL}
TAGS = obj(tags={"type": "array", "items": enum(MEMORY_TAGS), "minItems": 1})
# collective weight sync (gateway/collective_routes.py)
INT = {"type": "integer"}
JOIN = {"master_address": STR, "master_port": {**INT, "minimum": 1, "maximum": 65535}, "rank_offset": {**INT, "minimum": 1},
        "world_size": {**INT, "minimum": 2}}
SHAPES = {"type": "array", "items": {"type": "array", "items": {**INT, "minimum": 0}}}
TENSORS = {"names": {"type": "array", "items": STR, "minItems": 1}, "dtypes": {"type": "array", "items": enum(WIRE_DTYPES)},
           "shapes": SHAPES, "group_name": STR, "load_format": {"enum": [None, "flattened_bucket"]}}
ONE_TENSOR = {"name": STR, "dtype": enum(WIRE_DTYPES), "shape": SHAPES["items"]}  # SGLang's older form
UPDATE_INFO = obj(("names", "dtype_names", "shapes"), names=TENSORS["names"], dtype_names=TENSORS["dtypes"], shapes=SHAPES,
                  packed=BOOL, packed_buffer_size_bytes={**INT, "minimum": 1}, packed_num_buffers=INT, is_checkpoint_format=BOOL)
ERROR = obj(("error",), error=obj(("message", "type"), message=STR, type=STR, param={"type": ["string", "null"]},
                                  code={"type": ["string", "null"]}))


# -- each path's operation

@dataclass(frozen=True)
class Operation:
    summary: str
    # The JSON request body's schema, or the kind of body whose rows of gateway/fields.py it is
    # (built when the document is); None: the route reads no body
    body: dict | str | None = None
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
    "/v1/completions": Operation("OpenAI completion (text or token ids, one prompt or several)", COMPLETIONS, statuses=GENERATION,
                                 streams=True),
    "/v1/responses": Operation("OpenAI Responses API, as one chat completion", RESPONSES, statuses=GENERATION, streams=True),
    "/v1/responses/{response_id}": Operation("A stored response (GET), or forget it (DELETE); 404 for one this gateway does not "
                                             "hold", statuses=(404,)),
    "/v1/models": Operation("The served model's card and each loaded LoRA adapter's (parent: the served model)", statuses=(503,)),
    "/v1/models/{model}": Operation("One model's card (the served model or a LoRA adapter); 404 for any other name",
                                    statuses=(404, 503)),
    "/generate": Operation("SGLang's native generation (text or input_ids, batches, n samples)", GENERATE, statuses=(413, 503),
                           streams=True),
    "/v1/score": Operation("SGLang's scoring: the probability of each label token after query + item", SCORE, statuses=(413, 503)),
    "/health": Operation("200 when every service has a live instance and none is stalled, else 503 naming the missing "
                         "and stalled ones", statuses=(503,), own_errors=True),
    "/health_generate": Operation("200 when a one-token generation comes back in time", statuses=(503,), produces=""),
    "/stats": Operation("Each live service instance's stats by role", statuses=(503,)),
    "/metrics": Operation("Prometheus metrics", statuses=(503,), produces="text/plain"),
    "/openapi.json": Operation("This document"),
    "/version": Operation("The server's version"),
    "/abort_request": Operation("Abort a request by rid, or every request", ABORT, statuses=(413, 503),
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
    "/pause_generation": Operation("Pause every replica (new requests wait)", obj(mode=enum(PAUSE_MODES)), statuses=(413, 503)),
    "/continue_generation": Operation("Continue after a pause", obj(), body_optional=True, statuses=(413, 503)),
    "/update_weights_from_disk": Operation(
        "Load new weights from a checkpoint on every replica, then swap",
        obj(("model_path",), model_path=STR, load_format=enum(LOAD_FORMATS), abort_all_requests=BOOL, **UPDATE),
        statuses=(413, 500, 503)),
    "/update_weights_from_tensor": Operation(
        "Stage one bucket of tensors as safetensors bytes (JSON: base64 buffers; else the raw bytes, fields in the query)",
        obj(("serialized_named_tensors",), serialized_named_tensors={"type": "array", "items": STR, "minItems": 1},
             load_format={"const": "safetensors"}, last_bucket=BOOL, **UPDATE),
        query={"last_bucket": BOOL, **UPDATE}, statuses=(413, 500, 503), raw_body=True),
    "/update_weight_version": Operation("Set the weights' version name", obj(("new_version",), new_version=STR, abort_all_requests=BOOL),
                                        statuses=(413, 500, 503)),
    "/v1/load_lora_adapter": Operation(
        "vLLM's: load a LoRA adapter (a PEFT directory on the workers' machine) on every replica; a plain-text success",
        obj(("lora_name", "lora_path"), lora_name=STR, lora_path=STR, load_inplace=BOOL), statuses=(404, 413, 503), produces="text/plain"),
    "/v1/unload_lora_adapter": Operation("vLLM's: unload a LoRA adapter (requests running under it finish under it)",
                                         obj(("lora_name",), lora_name=STR), statuses=(404, 413, 503), produces="text/plain"),
    "/load_lora_adapter": Operation("SGLang's: load a LoRA adapter on every replica", obj(("lora_name", "lora_path"), lora_name=STR,
                                    lora_path=STR, pinned=BOOL), statuses=(404, 413, 503), own_errors=True),
    "/unload_lora_adapter": Operation("SGLang's: unload a LoRA adapter", obj(("lora_name",), lora_name=STR), statuses=(404, 413, 503),
                                      own_errors=True),
    "/load_lora_adapter_from_tensors": Operation(
        "Push one bucket of a LoRA adapter's tensors (PEFT names) as safetensors bytes, with its LoRA config; the last bucket loads it",
        obj(("lora_name", "config_dict", "serialized_named_tensors"), lora_name=STR,
             config_dict=obj(("r", "target_modules"), r={**INT, "minimum": 1}, lora_alpha={"type": "number"},
                             target_modules={"type": "array", "items": STR, "minItems": 1}, use_rslora=BOOL),
             serialized_named_tensors={"type": "array", "items": STR, "minItems": 1}, load_format={"const": "safetensors"},
             last_bucket=BOOL, weight_version=STR),
        query={"lora_name": STR, "r": INT, "lora_alpha": {"type": "number"}, "target_modules": STR, "use_rslora": BOOL,
               "last_bucket": BOOL, "weight_version": STR},
        statuses=(404, 413, 503), raw_body=True, own_errors=True),
    "/list_weights": Operation("Every checkpoint tensor the model reads", query={"prefix": STR}, statuses=(503,)),
    "/release_memory_occupation": Operation("Release the workers' device memory (weights, KV cache)", TAGS, body_optional=True,
                                            statuses=(413, 503)),
    "/resume_memory_occupation": Operation("Take the released device memory back", TAGS, body_optional=True, statuses=(413, 503)),
    "/inference/v1/generate": Operation("vLLM's tokens in, tokens out generation (the whole output, as vLLM's)", INFERENCE,
                                        statuses=(404, 413, 503)),
    "/pause": Operation("vLLM's pause of every replica: abort, wait for those in flight, or keep them frozen",
                        query=VLLM_PAUSE, statuses=(413, 503)),
    "/resume": Operation("vLLM's resume after /pause", statuses=(503,)),
    "/is_paused": Operation("Whether generation is paused", statuses=(503,)),
    "/sleep": Operation("vLLM's sleep: level 1 releases the KV cache, level 2 the weights too",
                        query={"level": {"type": "integer", "enum": [1, 2]}, "mode": VLLM_PAUSE["mode"]}, statuses=(413, 503)),
    "/wake_up": Operation("vLLM's wake up: the memory of the tags named (none: all) back",
                          query={"tags": {"type": "array", "items": enum(MEMORY_TAGS)}}, statuses=(413, 503)),
    "/is_sleeping": Operation("Whether device memory is released", statuses=(503,)),
    "/reset_prefix_cache": Operation("vLLM's prefix cache reset; running requests sent back to waiting first when asked",
                                     query={"reset_running_requests": BOOL, "reset_external": BOOL}, statuses=(413, 503),
                                     produces=""),
    "/get_world_size": Operation("vLLM's world size as its RL clients read it: the ranks a weight sync joins, one per replica (one replica's with include_dp=false)",
                                 query={"include_dp": BOOL}),
    "/tokenize": Operation("Text or chat messages to token ids", TOKENIZE, statuses=(413, 503)),
    "/v1/tokenize": Operation("Text or chat messages to token ids", TOKENIZE, statuses=(413, 503)),
    "/detokenize": Operation("Token ids to text", DETOKENIZE, statuses=(413, 503)),
    "/init_weights_update_group": Operation(
        "Every replica's worker joins the trainer's torch.distributed group, as rank rank_offset + its replica",
        obj(tuple(JOIN), **JOIN, group_name=STR, backend=enum(GROUP_BACKENDS)), statuses=(413, 503)),
    "/update_weights_from_distributed": Operation(
        "Receive one bucket of tensors the trainer broadcasts in the group, then swap it in",
        obj(**TENSORS, **ONE_TENSOR, abort_all_requests=BOOL, **UPDATE), statuses=(413, 500, 503)),
    "/prepare_weights_update": Operation(
        "Start receiving a bucket (or `buckets`) the trainer broadcasts; answered at once",
        obj(**TENSORS, buckets={"type": "array", "items": obj(("names", "dtypes", "shapes"), **TENSORS)}, transport={"const": "nccl_broadcast"}),
        statuses=(413, 503)),
    "/complete_weights_update": Operation("Wait for the prepared receives, then swap in what was staged",
                                          obj(group_name=STR, **UPDATE), statuses=(413, 500, 503)),
    "/receive_weights": Operation("Receive one bucket into the staging (swapped in by /complete_weights_update)",
                                  obj(**TENSORS, **ONE_TENSOR), statuses=(413, 503)),
    "/destroy_weights_update_group": Operation("Every replica's worker leaves the group", obj(group_name=STR), body_optional=True,
                                               statuses=(413, 503)),
    "/init_weight_transfer_engine": Operation(
        "vLLM's: every replica's worker joins the trainer's group (init_info), as rank rank_offset + its replica",
        obj(("init_info",), init_info=obj(tuple(JOIN), **JOIN, backend=enum(GROUP_BACKENDS))), statuses=(413, 503)),
    "/start_weight_update": Operation("vLLM's: begin an update (drops whatever was staged)", obj(is_checkpoint_format=BOOL),
                                      body_optional=True, statuses=(413, 503)),
    "/update_weights": Operation("vLLM's: receive tensors the trainer broadcasts (packed or not) into the staging",
                                 obj(("update_info",), update_info=UPDATE_INFO), statuses=(413, 503)),
    "/finish_weight_update": Operation("vLLM's: swap in what was staged", obj(weight_version={"type": ["string", "null"]}),
                                       body_optional=True, statuses=(413, 500, 503)),
    "/v1/detokenize": Operation("Token ids to text", DETOKENIZE, statuses=(413, 503)),
}
REASONS = {200: "OK", 400: "A bad request, naming the field", 401: "No key, or a wrong one",
           404: "No such model, or no such stored response", 413: "The body is over the server's size limit", 500: "Replicas failed to apply an update",
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
    for name in reversed(re.findall(r"{(\w+)}", path)):  # a path's own parameters first
        parameters.insert(0, {"name": name, "in": "path", "required": True, "schema": STR})
    if parameters:
        out["parameters"] = parameters
    statuses = {200, *op.statuses}
    if op.body is not None and method != "GET":
        content = {"application/json": {"schema": body_of(op.body) if isinstance(op.body, str) else op.body}}
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
