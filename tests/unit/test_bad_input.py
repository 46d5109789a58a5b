"""The gateway's checks of a whole body (gateway/body.py) and of the bounded fields (gateway/params.py):
each bad value a 400 naming where it is; good values at the edges pass."""

import asyncio
import logging

import msgspec
import pytest
from starlette.requests import Request

from gateway.body import parse_json, read_bounded
from gateway.errors import ApiError, invalid, log_rejected
from gateway.http import QuietDisconnects
from gateway.fields import MAX_TOKEN_ID
from gateway.params import logit_bias, sampling_params
from gateway.responses_routes import refuse_unimplemented
from jaxstream.config import ConfigError, ServerConfig
from jaxstream.protocol import SamplingParams


def refused(raw: bytes, max_depth: int = 128) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_json(raw, max_depth)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(("raw", "param", "phrase"), [
    (b'{"seed": 18446744073709551616}', "seed", "out of range"),  # 2**64
    (b'{"seed": 9223372036854775808}', "seed", "out of range"),  # 2**63
    (b'{"seed": -9223372036854775809}', "seed", "out of range"),
    (b'{"prompt": [1, 2, 99999999999999999999999]}', "prompt[2]", "out of range"),
    (b'{"sampling_params": {"stop_token_ids": [1, -99999999999999999999]}}', "sampling_params.stop_token_ids[1]", "out of range"),
    (b'{"max_tokens": 1' + b"0" * 5000 + b"}", "max_tokens", "out of range"),  # past Python's int-from-string limit
    (b'{"logit_bias": {"5": -' + b"9" * 5000 + b"}}", "logit_bias.5", "out of range"),
    (b'{"temperature": NaN}', "temperature", "got NaN"),
    (b'{"top_p": Infinity}', "top_p", "got Infinity"),
    (b'{"sampling_params": [{"min_p": -Infinity}]}', "sampling_params[0].min_p", "got -Infinity"),
    (b'{"temperature": 1e999}', "temperature", "finite"),
    (b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content", "lone UTF-16 surrogate"),
    (b'{"stop": ["ok", "\\udfff"]}', "stop[1]", "lone UTF-16 surrogate"),
    (b'{"metadata": {"\\ud800": 1}}', "metadata.\\ud800", "lone UTF-16 surrogate"),  # a key, named escaped
])
def test_a_value_the_wire_cannot_carry_is_a_400_naming_it(raw, param, phrase):
    error = refused(raw)
    assert error.param == param and phrase in error.message and param in error.message
    assert msgspec.json.encode(error.body())  # the answer itself encodes


def test_nesting_past_the_limit_names_the_top_field():
    deep = b'{"response_format": ' + b"[" * 200 + b"]" * 200 + b"}"
    error = refused(deep)
    assert error.param == "response_format" and "nested too deeply (more than 128 levels" in error.message
    assert parse_json(b'{"a": ' + b"[" * 127 + b"]" * 127 + b"}")  # 128 levels: the object, then 127 arrays
    assert "more than 4 levels" in refused(b'{"a": [[[[1]]]]}', max_depth=4).message
    assert "nested too deeply" in refused(b"[" * 10_000 + b"]" * 10_000).message  # past Python's own limit


def test_values_at_the_edges_pass():
    body = parse_json(b'{"a": [-9223372036854775808, 9223372036854775807, 0], "b": "\\ud83d\\ude00 caf\xc3\xa9", "c": -1.5e308,'
                      b' "d": {"e": [true, null, "x"]}}')
    assert body["a"][1] == 2**63 - 1 and body["b"] == "\U0001F600 caf\u00e9"
    assert msgspec.json.decode(msgspec.json.encode(body)) == body


@pytest.mark.parametrize(("raw", "phrase"), [(b"\xff{}", "not valid UTF-8"), (b'{"a": }', "not valid JSON"), (b"[1]", "JSON object"),
                                             (b'{"x": ' + b"9" * 5000 + b", }", "not valid JSON")])
def test_malformed_bodies(raw, phrase):
    assert phrase in refused(raw).message


def bounded_read(body: bytes, max_bytes: int, chunk: int = 1000, headers: list | None = None) -> tuple[bytes | ApiError, int]:
    """read_bounded over `body` sent in chunks: what it gives, and how many chunks it took."""
    chunks = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
    taken = 0

    async def receive():
        nonlocal taken
        taken += 1
        return {"type": "http.request", "body": chunks[taken - 1], "more_body": taken < len(chunks)}

    request = Request({"type": "http", "method": "POST", "path": "/", "headers": headers or []}, receive)
    try:
        return asyncio.run(read_bounded(request, max_bytes)), taken
    except ApiError as exc:
        return exc, taken


def test_a_body_over_the_limit_is_refused_while_it_is_read():
    assert bounded_read(b"x" * 5000, 5000) == (b"x" * 5000, 5)
    error, taken = bounded_read(b"x" * 100_000, 5000)
    assert isinstance(error, ApiError) and error.status == 413 and "larger than 5000 bytes" in error.message
    assert taken == 6  # stopped at the first chunk past the limit, the other 94 never read
    error, taken = bounded_read(b"x" * 10, 5, headers=[(b"content-length", b"10")])
    assert error.status == 413 and taken == 0  # a declared length over the limit: not a byte read


def test_bounded_fields():
    limits = ServerConfig(max_stop_strings=2, max_stop_string_chars=5, max_stop_token_ids=3, max_logit_bias=2)
    cases = [({"stop": ["a", "b", "c"]}, "stop", "at most 2 strings (server.max_stop_strings), got 3"),
             ({"stop": "abcdef"}, "stop", "at most 5 characters long (server.max_stop_string_chars)"),
             ({"stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids", "at most 3 token ids, got 4"),
             ({"logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias", "at most 2 entries (server.max_logit_bias), got 3"),
             ({"top_k": 2**31}, "top_k", f"in 0..{MAX_TOKEN_ID}")]
    for body, param, phrase in cases:
        with pytest.raises(ApiError) as caught:
            sampling_params(body, 8, limits=limits, prefix="")
        assert caught.value.param == param and phrase in caught.value.message, caught.value.message
    fine = sampling_params({"stop": ["a", "abcde"], "stop_token_ids": [1, 2, 3], "logit_bias": {"1": 1, "2": -1}, "top_k": MAX_TOKEN_ID,
                            "seed": 2**63 - 1}, 8, limits=limits)
    assert msgspec.json.decode(msgspec.json.encode(fine), type=SamplingParams) == fine
    with pytest.raises(ApiError, match="server.max_stop_strings"):  # the default bound
        sampling_params({"stop": [str(i) for i in range(65)]}, 8)


def test_a_logit_bias_key_of_thousands_of_digits_is_a_400():
    with pytest.raises(ApiError) as caught:
        logit_bias({"logit_bias": {"1" * 5000: 1.0, "7": 2.0}})
    assert caught.value.param == "logit_bias" and "keys must be token ids" in caught.value.message


def test_an_include_of_lists_is_a_400_not_a_500():
    with pytest.raises(ApiError) as caught:  # its items were put in a set: a list item raised TypeError
        refuse_unimplemented({"input": "hi", "include": [["message.output_text.logprobs"]]})
    assert caught.value.status == 400 and caught.value.param == "include"
    refuse_unimplemented({"input": "hi", "include": ["message.output_text.logprobs"]})


def test_one_log_line_per_refusal_and_no_disconnect_noise(caplog):
    request = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "query_string": b""})
    with caplog.at_level(logging.INFO, logger="gateway.errors"):
        log_rejected(request, invalid("'stop' holds\na newline " + "x" * 1000, "stop"))
        log_rejected(request, ApiError(499, "client disconnected"))
    [line] = caplog.records
    text = line.getMessage()
    assert text.startswith("POST /v1/chat/completions refused 400, param stop: ") and "\n" not in text and len(text) < 400
    assert line.exc_info is None
    noise = logging.LogRecord("asyncio", logging.WARNING, __file__, 1, "socket.send() raised exception.", (), None)
    other = logging.LogRecord("asyncio", logging.WARNING, __file__, 1, "Task was destroyed but it is pending!", (), None)
    assert not QuietDisconnects().filter(noise) and QuietDisconnects().filter(other)


def test_limits_are_config():
    with pytest.raises(ConfigError, match="server.max_json_depth"):
        ServerConfig(max_json_depth=0)
