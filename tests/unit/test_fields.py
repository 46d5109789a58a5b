"""The table of request fields (gateway/fields.py) is what the gateway reads requests with and what
`/openapi.json` lists: a row added to it is read by every route whose body carries it, and documented
there, with its range; the peers' spellings and the readers it names hold."""

import dataclasses
import functools
import importlib
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from gateway import fields
from gateway.app import build_app
from gateway.errors import ApiError
from gateway.fields import FIELDS, MIN_TOKENS, NO_STOP_TRIM, NUMBER, SAMPLED, SCORE, TEMPERATURE, TOP_K, Field
from gateway.params import read, sampling_params
from jaxstream.config import load_config
from jaxstream.keys import Keys
from jaxstream.protocol import SamplingParams

HI = [{"role": "user", "content": "hi"}]


class NoAdapters:
    """A bus whose only state is the LoRA adapters loaded: none."""

    async def adapters(self) -> dict[str, str]:
        return {}


class Recorder:
    """A pipeline that keeps the SamplingParams of the first request a route submits, and ends it there."""

    bus, draining = NoAdapters(), False

    def __init__(self) -> None:
        self.metrics = SimpleNamespace(group=lambda n, max_tokens: None)
        self.sampling: SamplingParams | None = None

    def new_rid(self) -> str:
        return "r"

    def stream(self, rid: str, sampling: SamplingParams, group=None, **prompt):
        self.sampling = sampling
        raise ApiError(503, "submitted")


def body_schema(doc: dict, path: str) -> dict:
    return doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def test_a_row_added_to_the_table_is_read_by_its_routes_and_listed_in_the_document(monkeypatch):
    row = Field("min_prob", NUMBER, SAMPLED, "A narrower min_p, as a new peer spells it", fills="min_p", minimum=0, maximum=0.5)
    monkeypatch.setattr(fields, "FIELDS", (*FIELDS, row))
    pipeline = Recorder()
    client = TestClient(build_app(None, pipeline, load_config(["worker=fake"]), None, Keys()))
    for path, body, prefix in (("/v1/chat/completions", {"messages": HI}, ""), ("/v1/completions", {"prompt": "hi"}, ""),
                               ("/v1/responses", {"input": "hi"}, ""), ("/generate", {"text": "hi"}, "sampling_params.")):
        def holding(value):
            return {**body, "sampling_params": {"min_prob": value}} if prefix else {**body, "min_prob": value}
        refused = client.post(path, json=holding(0.75)).json()["error"]
        assert refused["param"] == f"{prefix}min_prob" and refused["message"] == f"'{prefix}min_prob' must be in [0, 0.5], got 0.75"
        assert client.post(path, json=holding(0.25)).status_code == 503 and pipeline.sampling.min_p == 0.25, path
    doc = client.get("/openapi.json").json()
    generate = body_schema(doc, "/generate")["properties"]["sampling_params"]["oneOf"][0]
    for schema in (*(body_schema(doc, path) for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses")), generate):
        assert schema["properties"]["min_prob"] == {"type": "number", "minimum": 0, "maximum": 0.5, "default": 0.0,
                                                    "description": "A narrower min_p, as a new peer spells it"}
    assert "min_prob" not in body_schema(doc, "/v1/score")["properties"]


def test_a_field_is_read_under_the_first_spelling_given_and_refused_by_its_own_name():
    assert read({"min_tokens": 2, "min_new_tokens": 5}, MIN_TOKENS) == 2
    assert read({"min_new_tokens": 5}, MIN_TOKENS) == 5 and read({}, MIN_TOKENS) == SamplingParams().min_new_tokens
    with pytest.raises(ApiError) as wrong_kind:
        read({"min_new_tokens": "5"}, MIN_TOKENS, prefix="sampling_params.")
    assert wrong_kind.value.param == "sampling_params.min_new_tokens" and wrong_kind.value.code == "invalid_type"
    with pytest.raises(ApiError) as out_of_range:
        read({"min_new_tokens": -1}, MIN_TOKENS, prefix="sampling_params.")
    assert out_of_range.value.message == "'sampling_params.min_tokens' must be >= 0, got -1"
    # a flag is set by either engine's spelling, whichever comes first
    assert read({"no_stop_trim": False, "include_stop_str_in_output": True}, NO_STOP_TRIM) is True
    assert sampling_params({"sampling_seed": 7, "top_k": 0}, 8, where=fields.SAMPLING_PARAMS) == SamplingParams(8, seed=7)


def test_ranges_are_refused_in_the_words_clients_match():
    cases = [(TEMPERATURE, -1, "'temperature' must be >= 0, got -1.0"),
             (TOP_K, -2, f"'top_k' must be -1 (off) or in 0..{fields.MAX_TOKEN_ID}, got -2"),
             (fields.TOP_P, 0, "'top_p' must be in (0, 1], got 0.0"),
             (fields.TRUNCATE_PROMPT_TOKENS, 0, "'truncate_prompt_tokens' must be -1 or >= 1, got 0"),
             (fields.TRUNCATION_SIDE, "middle", "'truncation_side' must be \"left\" or \"right\", got \"middle\""),
             (fields.ROUTED_EXPERTS_START_LEN, -1, "'routed_experts_start_len' must be within [0, prompt tokens], got -1")]
    for row, value, message in cases:
        with pytest.raises(ApiError) as caught:
            read({row.name: value}, row)
        assert caught.value.message == message and caught.value.param == row.name
    assert read({"top_k": -1}, TOP_K) == -1 and read({"truncate_prompt_tokens": -1}, fields.TRUNCATE_PROMPT_TOKENS) == -1


def test_a_row_that_fills_sampling_params_takes_its_default_from_there():
    for row in FIELDS:
        if row.fills:
            assert row.default == getattr(SamplingParams(), row.fills), row.name
    with pytest.raises(ValueError, match="its default is that field's"):
        Field("temperature", NUMBER, SAMPLED, "a second default", fills="temperature", default=0.7)


def test_every_row_is_in_the_table_and_names_a_reader_that_exists():
    rows = [value for value in vars(fields).values() if isinstance(value, Field)]
    assert len(rows) == len(FIELDS) and all(any(row is listed for listed in FIELDS) for row in rows)
    for row in FIELDS:
        if row.reader:
            module, *names = row.reader.split(".")
            reader = functools.reduce(getattr, names, importlib.import_module(f"gateway.{module}"))
            assert callable(reader), row.reader
        assert row.bodies and row.says and set(row.required_in) <= set(row.bodies), row.name
    assert dataclasses.replace(TEMPERATURE, minimum=1).default == TEMPERATURE.default
    assert all(SCORE not in row.bodies or not row.fills for row in FIELDS)  # scoring sets its own sampling
