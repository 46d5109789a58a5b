"""Bad input through the whole fake stack: every case of issue 17's 38 malformed requests that got
a 500 (integers past 2**64, JSON nested 10,000 deep, lone surrogates, 5,000-digit integers), NaN and
Infinity, a body over the size limit and over-long stop lists, on chat, completions and /generate:
each a 400 (413 for the size) in OpenAI's error shape, and the server healthy and serving after.
Then a seeded mini-fuzz: mutations of valid bodies, never a 5xx."""

import json
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
MODEL = "SmolLM2-135M-Instruct"
VALID = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "seed": 7,
                             "stop": ["x"], "stop_token_ids": [5], "logit_bias": {"10": 1.0}, "top_k": 5, "temperature": 0.5},
    "/v1/completions": {"model": MODEL, "prompt": [1000, 2000], "max_tokens": 2, "seed": 7, "stop": ["x"], "top_p": 0.9,
                        "stop_token_ids": [5], "logit_bias": {"10": 1.0}, "logprobs": 1, "prompt_logprobs": 1},
    "/generate": {"input_ids": [1000, 2000], "return_logprob": True, "logprob_start_len": 0, "token_ids_logprob": [3],
                  "sampling_params": {"max_new_tokens": 2, "seed": 7, "stop": ["x"], "stop_token_ids": [5], "top_k": 5,
                                      "min_new_tokens": 1, "logit_bias": {"10": 1.0}}},
}
HUGE = "1" + "0" * 5000  # 5,000 digits: past Python's int-from-string limit


def post_raw(stack: str, path: str, raw: bytes | str) -> httpx.Response:
    return httpx.post(stack + path, content=raw.encode() if isinstance(raw, str) else raw, headers={"content-type": "application/json"},
                timeout=30)


def with_field(path: str, field: str, value_json: str) -> str:
    """VALID[path] as JSON text with `field` (dotted: sampling_params.seed) set to the raw JSON `value_json`."""
    body = json.loads(json.dumps(VALID[path]))
    *outer, last = field.split(".")
    holder = body
    for key in outer:
        holder = holder[key]
    holder[last] = "@@VALUE@@"
    return json.dumps(body).replace('"@@VALUE@@"', value_json)


def assert_refused(r: httpx.Response, status: int = 400, param: str | None = None) -> dict:
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_serving(stack: str) -> None:
    assert httpx.get(stack + "/health", timeout=10).status_code == 200
    r = httpx.post(stack + "/v1/completions", json={"model": MODEL, "prompt": [1000, 2000], "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


@pytest.fixture(scope="module")
def stack(fake_stack):
    return fake_stack


def test_the_valid_bodies_are_served(stack):
    for path in VALID:
        assert post_raw(stack, path, json.dumps(VALID[path])).status_code == 200, path


INTEGER_FIELDS = {
    "/v1/chat/completions": ["seed", "max_tokens", "top_k", "n", "stop_token_ids", "logit_bias.10"],
    "/v1/completions": ["seed", "max_tokens", "logprobs", "prompt", "prompt_logprobs", "stop_token_ids"],
    "/generate": ["input_ids", "logprob_start_len", "token_ids_logprob", "sampling_params.seed", "sampling_params.max_new_tokens",
                  "sampling_params.top_k", "sampling_params.min_new_tokens", "sampling_params.stop_token_ids"],
}


@pytest.mark.parametrize("path", list(VALID))
def test_integers_past_int64_and_of_5000_digits(stack, path):
    for field in INTEGER_FIELDS[path]:
        for value in (str(2**64), str(-(2**63) - 1), HUGE, "-" + HUGE):
            as_list = field in ("prompt", "input_ids", "stop_token_ids", "token_ids_logprob", "sampling_params.stop_token_ids")
            error = assert_refused(post_raw(stack, path, with_field(path, field, f"[1, {value}]" if as_list else value)))
            assert ("out of range" in error["message"] or "must be" in error["message"]) and error["param"].startswith(field.split(".")[0])


@pytest.mark.parametrize("path", list(VALID))
def test_non_finite_floats(stack, path):
    field = "sampling_params.temperature" if path == "/generate" else "temperature"
    for value in ("NaN", "Infinity", "-Infinity", "1e999"):
        error = assert_refused(post_raw(stack, path, with_field(path, field, value)), param=field)
        assert "finite" in error["message"]


def test_lone_surrogates_in_prompt_messages_and_stop(stack):
    cases = [("/v1/chat/completions", "messages", '[{"role": "user", "content": "hi \\ud800"}]', "messages[0].content"),
             ("/v1/chat/completions", "stop", '["ok", "\\udc00"]', "stop[1]"),
             ("/v1/completions", "prompt", '"caf\\udfff"', "prompt"),
             ("/v1/completions", "stop", '"\\ud83d"', "stop"),
             ("/generate", "input_ids", "null", None),
             ("/generate", "sampling_params.stop", '["\\ud800x"]', "sampling_params.stop[0]")]
    for path, field, value, param in cases:
        raw = with_field(path, field, value)
        if path == "/generate" and field == "input_ids":
            raw = raw.replace('"input_ids": null', '"text": "a \\udbff b"')
            param = "text"
        error = assert_refused(post_raw(stack, path, raw), param=param)
        assert "lone UTF-16 surrogate" in error["message"]


@pytest.mark.parametrize("path", list(VALID))
def test_json_nested_10000_deep_and_past_the_limit(stack, path):
    for depth in (10_000, 129):
        raw = with_field(path, "extra", "[" * depth + "]" * depth)
        assert "nested too deeply" in assert_refused(post_raw(stack, path, raw))["message"]


def test_a_body_over_the_size_limit_is_a_413(stack):
    raw = with_field("/v1/completions", "padding", json.dumps("x" * (32 * 1024 * 1024 + 1)))
    error = assert_refused(post_raw(stack, "/v1/completions", raw), status=413)
    assert error["code"] == "request_too_large" and "server.max_body_bytes" in error["message"]

    def chunks():  # no Content-Length: refused once the bytes read pass the limit
        yield raw[: len(raw) // 2].encode()
        yield raw[len(raw) // 2 :].encode()

    r = httpx.post(stack + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert_refused(r, status=413)
    assert_serving(stack)


def test_over_limit_stop_lists(stack):
    for path, prefix in (("/v1/chat/completions", ""), ("/v1/completions", ""), ("/generate", "sampling_params.")):
        cases = [("stop", json.dumps([f"s{i}" for i in range(65)]), "at most 64 strings"),
                 ("stop", json.dumps(["x" * 1025]), "at most 1024 characters"),
                 ("stop_token_ids", json.dumps(list(range(129))), "at most 128 token ids"),
                 ("logit_bias", json.dumps({str(i): 1 for i in range(1025)}), "at most 1024 entries")]
        for field, value, phrase in cases:
            error = assert_refused(post_raw(stack, path, with_field(path, prefix + field, value)), param=prefix + field)
            assert phrase in error["message"]
    assert_serving(stack)


def test_healthy_and_serving_after_all_of_it(stack):
    assert_serving(stack)


# -- a seeded mini-fuzz: valid bodies with one value (or two) replaced by a bad or edge one

NASTY = [str(2**64), str(-(2**63) - 1), str(2**63 - 1), str(-(2**63)), str(2**31), "-1", "0", HUGE, "NaN", "Infinity", "1e999",
         "-1e308", "0.5", '"\\ud800"', '"x\\udfffy"', '""', '"a"', "true", "false", "null", "[]", "{}", "[" * 300 + "]" * 300,
         '[1, 2, 340282366920938463463374607431768211456]', '{"\\ud800": 1}', '["a", null]', '[[1], [2]]', '{"1": NaN}']
# Values that would make a valid request run long on the fake worker (it stops only at max tokens)
SLOW = {"max_tokens", "max_new_tokens", "max_completion_tokens", "min_tokens", "min_new_tokens"}


def mutated(rng: random.Random, path: str) -> str:
    body = json.loads(json.dumps(VALID[path]))
    placed = []
    for _ in range(rng.choice((1, 1, 2))):
        holder, key = body, None
        while True:  # walk down to a random field
            keys = list(holder) if isinstance(holder, dict) else list(range(len(holder)))
            if not keys:
                break
            key = rng.choice(keys)
            if isinstance(holder[key], (dict, list)) and rng.random() < 0.6:
                holder = holder[key]
                continue
            break
        if key is None:
            continue
        value = rng.choice(NASTY)
        if key in SLOW and value in (str(2**63 - 1), str(2**31)):
            value = "-1"
        marker = f"@@{len(placed)}@@"
        holder[key] = marker
        placed.append((marker, value))
    text = json.dumps(body)
    for marker, value in placed:
        text = text.replace(json.dumps(marker), value)
    return text


def test_seeded_mutations_never_get_a_5xx(stack):
    rng = random.Random(17)
    cases = [(path, mutated(rng, path)) for path in (rng.choice(list(VALID)) for _ in range(300))]
    # Fresh connections, four at a time: a kept-alive one waits out delayed ACKs (~40 ms a request here)
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda case: post_raw(stack, *case), cases))
    statuses = Counter(r.status_code for r in responses)
    for (path, raw), r in zip(cases, responses):
        assert r.status_code < 500, (path, raw[:300], r.text[:300])
        if r.status_code >= 400:
            assert r.json()["error"]["message"]
    assert statuses[400] > 100 and statuses[200] > 5, statuses  # both kinds of outcome were exercised
    assert_serving(stack)
