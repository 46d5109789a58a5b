"""Fuzz the gateway from its own /openapi.json, and with issue 17's malformed bodies: no request may
get a 5xx, and the server must be healthy after.

1. Schemathesis generates requests for every operation of the document (each route and method),
   `--examples` of them per operation and mode: positive (bodies valid by the schema, which the
   gateway may still refuse on meaning) and negative (wrong kinds, missing fields, bytes that are
   not JSON). Seeded: the same seed, schemathesis and hypothesis give the same requests.
2. Hand-written cases on every JSON route: the values the wire cannot carry (integers past 2**64-1
   and of 5,000 digits, NaN and the infinities, lone surrogates), JSON nested 10,000 deep, bodies
   that are not JSON or not objects, bodies over the size limit (with and without Content-Length),
   and each integer field of a served body at the edges of int64 (what the whole-body check lets
   through, for the field readers to refuse).
3. Everything but the control routes is sent concurrently. The routes that stop serving on
   purpose (/pause_generation and vLLM's /pause hold new requests, /release_memory_occupation and
   vLLM's /sleep answer them 503) run alone, last, each case followed by its undo
   (/continue_generation, /resume; /resume_memory_occupation or /wake_up, then the weights loaded
   again from the served model_path, since a resume awaits their values).
4. It prints the requests sent, the count of each status, and every 5xx (or hang) with its
   request; exit status 1 when there was one, or when /health is not 200 after.

The fake worker generates until max tokens, so generated requests have their token counts capped
(CAPS) where a value is in range: a run measures the handling of input, not generation.

    python benchmarks/fuzz.py                       # starts `jaxstream up worker=fake` itself
    python benchmarks/fuzz.py --url http://127.0.0.1:8000 --examples 40 --seed 17

Needs schemathesis (the `test` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's stack package

RELOAD = "/update_weights_from_disk"  # with the served model_path: the weights' values after a resume
CONTROL = {"/pause_generation": ("/continue_generation",), "/pause": ("/resume",),
           "/release_memory_occupation": ("/resume_memory_occupation", RELOAD), "/sleep": ("/wake_up", RELOAD)}
LENGTHS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens")
MOST_TOKENS, MOST_N, MOST_WAIT_S = 16, 8, 1.0
HUGE = "1" + "0" * 5000  # 5,000 digits: past Python's int-from-string limit
# A served body per route, for the edge values of its integer fields (the rest get `{}`)
SERVED = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "seed": 1, "top_k": 5, "n": 1,
                             "stop_token_ids": [5], "logprobs": True, "top_logprobs": 1, "prompt_logprobs": 1,
                             "truncate_prompt_tokens": 8, "min_tokens": 1},
    "/v1/completions": {"prompt": [1000, 2000], "max_tokens": 2, "seed": 1, "logprobs": 1, "n": 1, "top_k": 3, "min_tokens": 0,
                        "allowed_token_ids": [7, 8], "routed_experts_start_len": 0},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 2, "top_logprobs": 1},
    "/inference/v1/generate": {"token_ids": [1000, 2000],
                               "sampling_params": {"max_tokens": 2, "seed": 1, "top_k": 5, "n": 1, "logprobs": 1, "prompt_logprobs": 1,
                                                   "min_tokens": 1, "stop_token_ids": [5]}},
    "/generate": {"input_ids": [1000, 2000], "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1,
                  "token_ids_logprob": [3], "sampling_params": {"max_new_tokens": 2, "seed": 1, "top_k": 5, "min_new_tokens": 1,
                                                                "n": 1, "stop_token_ids": [5]}},
    "/v1/score": {"query": [1000], "items": [[2000], [3000]], "label_token_ids": [5, 6]},
    "/tokenize": {"prompt": "Hello there"},
    "/detokenize": {"tokens": [1000, 2000]},
}
INT_EDGES = (2**63 - 1, -(2**63), 2**32, 2**31, -1, 0)


@dataclass
class Call:
    """One request to send, and how it went."""

    label: str  # what made it: an operation and mode, or a hand-written case
    method: str
    path: str
    content: bytes | None = None
    params: dict | None = None
    content_type: str | None = "application/json"
    chunked: bool = False  # sent without Content-Length
    status: int | str = 0  # the HTTP status, or "hang" / an exception's name
    answer: str = ""  # the response's start (kept for 5xx and failed streams)
    route: str = ""  # the document's path (`/v1/models/{model}`); "": `path`

    def request_text(self) -> str:
        body = (self.content or b"")[:400]
        query = f"?{self.params}" if self.params else ""
        return f"{self.method} {self.path}{query} ({self.label}) body[{len(self.content or b'')}]: {body!r}"


# -- 1. from the document

def capped(value: object, most_len: int) -> object:
    """A generated body with its token counts and samples cut where they are in range (CAPS above)."""
    if isinstance(value, list):
        return [capped(v, most_len) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: capped(v, most_len) for k, v in value.items()}
    for key in LENGTHS:
        if type(out.get(key)) is int and MOST_TOKENS < out[key] <= most_len:
            out[key] = MOST_TOKENS
    if type(out.get("n")) is int and MOST_N < out["n"] <= 128:
        out["n"] = MOST_N
    return out


def generated(doc: dict, examples: int, seed: int, most_len: int) -> list[Call]:
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seeded

    schema = schemathesis.openapi.from_dict(doc)
    calls = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in schemathesis.GenerationMode:
            cases = []

            @seeded(seed)
            @settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(operation.as_strategy(generation_mode=mode))
            def collect(case) -> None:
                cases.append(case)

            try:
                collect()
            except Exception as exc:  # an operation with nothing to break (no parameters) has no negative cases
                if mode is schemathesis.GenerationMode.POSITIVE:
                    raise
                print(f"  no {mode.value} cases for {operation.label}: {type(exc).__name__}", file=sys.stderr)
            calls += [as_call(case, f"{operation.label} [{mode.value}]", most_len) for case in cases]
    return calls


def as_call(case, label: str, most_len: int) -> Call:
    kwargs = case.as_transport_kwargs(base_url="")
    path = case.formatted_path
    params = {k: v for k, v in (kwargs.get("params") or {}).items()}
    if path == "/flush_cache" and "timeout" in params:  # it waits that long for the server to go idle
        try:
            params["timeout"] = min(float(params["timeout"]), MOST_WAIT_S)
        except (TypeError, ValueError):
            pass
    content_type = kwargs.get("headers", {}).get("Content-Type")
    if "json" in kwargs:
        content = json.dumps(capped(kwargs["json"], most_len)).encode()
    elif kwargs.get("data") is not None:
        data = kwargs["data"]
        content = data if isinstance(data, bytes) else str(data).encode("utf-8", "surrogatepass")
    else:
        content = None
    return Call(label, case.method.upper(), path, content, params or None, content_type, route=case.path)


# -- 2. by hand

def raw(body: dict, field: str, value_json: str) -> bytes:
    """`body` as JSON text with `field` set to the raw JSON text `value_json`."""
    marker = "@@VALUE@@"
    return json.dumps({**body, field: marker}).replace(json.dumps(marker), value_json).encode()


def integer_fields(body: dict, prefix: str = "") -> list[tuple[str, Callable[[object], dict]]]:
    """(name, set) for each integer-valued field of `body`, nested objects included; `set(v)` is
    the body with that field at v (an id list: its last id)."""
    out = []
    for key, value in body.items():
        def put(v, key=key):
            return {**body, key: v}
        if type(value) is int:
            out.append((prefix + key, put))
        elif isinstance(value, list) and value and all(type(v) is int for v in value):
            out.append((prefix + key, lambda v, key=key, value=value: {**body, key: [*value[:-1], v]}))
        elif isinstance(value, dict):
            out += [(name, lambda v, key=key, inner=inner: {**body, key: inner(v)}) for name, inner in integer_fields(value, f"{key}.")]
    return out


def by_hand(doc: dict, max_body_bytes: int, max_depth: int) -> list[Call]:
    calls = []
    json_routes = [(path, method.upper()) for path, ops in doc["paths"].items() for method, op in ops.items()
                   if "application/json" in op.get("requestBody", {}).get("content", {}) and path not in CONTROL]
    bad_values = [str(2**64), str(-(2**63) - 1), HUGE, "-" + HUGE, "NaN", "Infinity", "-Infinity", "1e999", '"\\ud800"',
                  '"ok \\udfff"', '{"\\udbff": 1}', "[" * 10_000 + "]" * 10_000, "[" * (max_depth + 1) + "]" * (max_depth + 1),
                  '[1, 2, 340282366920938463463374607431768211456]']
    whole = [b"", b"null", b"[]", b'"text"', b"17", b'{"a": ', b'{"a": 1}}', b"\xff\xfe{}", b'{"a": "\xed\xa0\x80"}',
             b"[" * 10_000 + b"]" * 10_000, b'{"a": 1, "a": 2}']
    oversized = b'{"padding": ' + json.dumps("x" * (max_body_bytes + 1)).encode() + b"}"  # one copy, shared
    for path, method in json_routes:
        base = SERVED.get(path, {})
        for value in bad_values:
            calls.append(Call(f"bad value {value[:24]}", method, path, raw(base, "fuzzed", value)))
            for name, put in integer_fields(base)[:2]:  # where a field reader would read it
                calls.append(Call(f"bad value in {name}", method, path, json.dumps(put("@@")).replace('"@@"', value).encode()))
        calls += [Call(f"whole body {content[:16]!r}", method, path, content) for content in whole]
        for name, put in integer_fields(base):
            calls += [Call(f"{name} = {edge}", method, path, json.dumps(put(edge)).encode()) for edge in INT_EDGES]
        calls.append(Call("over the size limit", method, path, oversized))
    calls.append(Call("over the size limit, chunked", "POST", "/v1/completions", oversized, chunked=True))
    return calls


# -- 3. sending

def send(base_url: str, call: Call, timeout_s: float) -> Call:
    headers = {"content-type": call.content_type} if call.content_type and call.content is not None else {}
    content = call.content
    if call.chunked and content is not None:
        whole = content
        content = iter([whole[: len(whole) // 2], whole[len(whole) // 2 :]])
    try:
        # a fresh connection each: a kept-alive one waits out delayed ACKs (~40 ms a request here)
        r = httpx.request(call.method, base_url + call.path, content=content, params=call.params, headers=headers, timeout=timeout_s)
        call.status = r.status_code
        text = r.text
        if r.status_code >= 500 or (r.status_code == 200 and failed_stream(text)):
            call.answer = text[:600]
    except httpx.TimeoutException:
        call.status = "hang"
    except httpx.HTTPError as exc:
        call.status = type(exc).__name__
    return call


def failed_stream(text: str) -> bool:
    """A 200 event stream that ended in a server-side error event (a 5xx after the status went out)."""
    return "data: " in text and ('"type": "internal_server_error"' in text or '"type":"internal_server_error"' in text)


def run_all(base_url: str, calls: list[Call], concurrency: int, timeout_s: float) -> None:
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda c: send(base_url, c, timeout_s), calls))


def run_control(base_url: str, calls: list[Call], timeout_s: float, model_path: str) -> list[Call]:
    """Each stop-serving case alone, then its undo (sent, counted and checked too)."""
    undos = []
    reload = json.dumps({"model_path": model_path}).encode()
    for call in calls:
        send(base_url, call, timeout_s)
        undos += [send(base_url, Call("undo", "POST", path, reload if path == RELOAD else None), timeout_s) for path in CONTROL[call.path]]
    return undos


def bad(call: Call) -> bool:
    return not isinstance(call.status, int) or call.status >= 500 or bool(call.answer)


def fuzz(base_url: str, examples: int, seed: int, concurrency: int = 8, timeout_s: float = 60, hand: bool = True,
         every: int = 1) -> tuple[list[Call], bool]:
    """(every call sent, whether /health was 200 after). `every`: keep every k-th hand-written case."""
    doc = httpx.get(base_url + "/openapi.json", timeout=30).json()
    most_len = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0].get("max_model_len") or 1 << 20
    calls = generated(doc, examples, seed, most_len)
    if hand:
        info = httpx.get(base_url + "/get_server_info", timeout=30).json()["config"]["server"]
        calls += by_hand(doc, info["max_body_bytes"], info["max_json_depth"])[::every]
    control = [c for c in calls if c.path in CONTROL]
    run_all(base_url, [c for c in calls if c.path not in CONTROL], concurrency, timeout_s)
    model_path = httpx.get(base_url + "/get_model_info", timeout=30).json()["model_path"]
    calls += run_control(base_url, control, timeout_s, model_path)
    healthy = httpx.get(base_url + "/health", timeout=30).status_code == 200
    return calls, healthy


def report(calls: list[Call], healthy: bool, elapsed: float) -> bool:
    statuses = Counter(str(c.status) for c in calls)
    print(f"requests sent: {len(calls)} in {elapsed:.1f} s")
    print("status counts: " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items())))
    by_route = Counter(c.route or c.path for c in calls)
    print("per route: " + ", ".join(f"{p} {n}" for p, n in sorted(by_route.items())))
    failures = [c for c in calls if bad(c)]
    print(f"5xx, hangs or failed streams: {len(failures)}")
    for c in failures:
        print(f"  {c.status} <- {c.request_text()}\n     answer: {c.answer[:300]!r}")
    print(f"/health after: {'200' if healthy else 'NOT 200'}")
    return not failures and healthy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running gateway; default: start `jaxstream up worker=fake`")
    parser.add_argument("--examples", type=int, default=40, help="generated requests per operation and mode")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--no-hand", action="store_true", help="only the generated requests")
    args = parser.parse_args()

    def run(base_url: str) -> bool:
        started = time.monotonic()
        calls, healthy = fuzz(base_url, args.examples, args.seed, args.concurrency, hand=not args.no_hand)
        return report(calls, healthy, time.monotonic() - started)

    if args.url:
        ok = run(args.url.rstrip("/"))
    else:
        from stack.bench.stacks import jaxstream_up

        with jaxstream_up(["worker=fake"]) as base_url:
            ok = run(base_url)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
