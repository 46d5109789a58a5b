"""Constrained decoding on the worker (worker_svc/constrained.py, layers/token_mask.py): each row's
mask is llguidance's own answer for the tokens its request produced, and every output the engine
samples under a constraint, with overlap, chunked prefill, preemption and the prefix cache, is a
prefix of a match, and a whole match when it ends on the end-of-sequence token.

The model is a tiny Llama with random weights over SmolLM2's 49,152-token vocabulary: its choices
among the allowed tokens are arbitrary, which walks the grammars far more widely than a trained
model would (the pipeline tests run the real one)."""

import json
from typing import Literal

import jsonschema
import llguidance
import numpy as np
import pydantic
import pytest
from flax import nnx

from jaxstream import grammar
from jaxstream.arrays import to_wire
from jaxstream.protocol import Constraint, SamplingParams, Step, StepSeq
from tests.worker.conftest import PAGE_SIZE
from tests.worker.driver import Driver
from worker_svc.batch import Buckets
from worker_svc.constrained import Constraints, bitmask_width
from worker_svc.engine import Engine
from worker_svc.layers.token_mask import apply_token_mask
from worker_svc.models.llama import Llama, LlamaConfig

EOS = 2  # SmolLM2's <|im_end|>
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
     "required": ["color", "ok", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}},
                                                "required": ["x"], "additionalProperties": False}},
     "required": ["inner"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def constraints(tokenizer_info):
    return Constraints.for_tokenizer(tokenizer_info.tokenizer, tokenizer_info.vocab_size, tokenizer_info.eos_token_ids)


def _seq(rid: str, slot: int, prompt_len: int, context_len: int, sampling: SamplingParams | None = None) -> StepSeq:
    return StepSeq(rid, 0, 1, context_len, True, sampling, prompt_len=prompt_len, slot=slot)


def test_masks_are_the_librarys_own_along_a_random_walk(constraints, tokenizer_info):
    """Two requests in two slots, one unconstrained between them: at every step each constrained
    row's mask equals a separate llguidance matcher's, fed the same tokens; the unconstrained row's
    is all ones; and a token drawn from the mask always keeps the matcher in a valid state."""
    rng = np.random.default_rng(0)
    asked = [Constraint("json_schema", json.dumps(SCHEMAS[1])), None, Constraint("regex", r"[a-z]{1,12}@(mail|post)\.(com|org)")]
    params = [SamplingParams(constraint=c) for c in asked]
    reference = [None if c is None else llguidance.LLMatcher(constraints.tokenizer, grammar.grammar(c)) for c in asked]
    prompt_len = 5

    def step(context_len, first):
        seqs = tuple(_seq(f"r{i}", i, prompt_len, context_len, p if first else None) for i, p in enumerate(params))
        return Step(1, seqs, to_wire(np.zeros(3, np.int32)), to_wire(np.zeros(3, np.int32)), to_wire(np.zeros((3, 1), np.int32)))

    walked = 0
    for n in range(40):
        s = step(prompt_len + n, n == 0)
        constraints.admit(s, params)
        masks, ending = constraints.masks(list(s.seqs), params, 4)
        assert masks.shape == (4, bitmask_width(tokenizer_info.vocab_size)) and (masks[1] == -1).all() and (masks[3] == -1).all()
        tokens = []
        for r, ref in enumerate(reference):
            if ref is None:
                tokens.append(int(rng.integers(tokenizer_info.vocab_size)))
                continue
            if not ref.is_stopped():  # its bitmask has a word to spare past the vocabulary, always 0
                expected = np.frombuffer(ref.compute_bitmask(), np.int32)
                assert not expected[masks.shape[1]:].any()
                np.testing.assert_array_equal(masks[r], expected[: masks.shape[1]])
            allowed = np.flatnonzero(np.unpackbits(masks[r].view(np.uint8), bitorder="little")[: tokenizer_info.vocab_size])
            token = int(rng.choice(allowed))
            if not ref.is_stopped():
                assert ref.consume_token(token), ref.get_error()
                walked += 1
            tokens.append(token)
        constraints.sampled(list(s.seqs), params, tokens)
    assert walked >= 20
    assert reference[0].is_stopped() or not reference[0].is_error()


def test_a_stopped_matcher_allows_only_the_end_token(constraints):
    params = [SamplingParams(constraint=grammar.from_choice(["yes"]))]

    seqs = [_seq("c", 0, 3, 3, params[0])]
    constraints.admit(Step(1, tuple(seqs), to_wire(np.zeros(1, np.int32)), to_wire(np.zeros(1, np.int32)), to_wire(np.zeros((1, 1), np.int32))), params)
    yes = constraints.tokenizer.tokenize_str("yes")
    for i, token in enumerate(yes):
        constraints.sampled([_seq("c", 0, 3, 3 + i)], params, [token])
    constraints.sampled([_seq("c", 0, 3, 3 + len(yes))], params, [EOS])  # the end: the matcher stops
    masks, ending = constraints.masks([_seq("c", 0, 3, 4 + len(yes))], params, 1)
    assert ending == [0]
    mask = masks[0]
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    assert np.flatnonzero(bits).tolist() == [EOS]


def test_a_finished_match_ends_under_min_tokens_with_its_text_whole(random_engine, tokenizer_info):
    """min_tokens bans the stop tokens, and a complete match allows only the end token: the ban is
    lifted for such a row, which samples end tokens (invisible in the text) until min_tokens, then stops."""
    tok = tokenizer_info.tokenizer
    s = SamplingParams(max_new_tokens=40, min_new_tokens=12, temperature=1.0, seed=1, stop_token_ids=(EOS,),
                       constraint=grammar.from_choice(["yes", "no"]))
    tokens = Driver(random_engine, PAGE_SIZE, 40, 16, 8, overlap=True).run([("m", tok.encode("Answer:"), s)])["m"].tokens
    assert len(tokens) == 12 and tokens[-1] == EOS, tokens
    assert tok.decode(tokens, skip_special_tokens=True) in ("yes", "no")


def test_the_mask_sets_every_token_outside_it_to_minus_infinity():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 70)).astype(np.float32)
    allowed = rng.random((3, 70)) < 0.3
    words = np.zeros((3, bitmask_width(70)), np.uint32)
    for r, v in zip(*np.nonzero(allowed)):
        words[r, v // 32] |= np.uint32(1 << (v % 32))
    out = np.asarray(apply_token_mask(logits, words.view(np.int32)))
    np.testing.assert_array_equal(out, np.where(allowed, logits, -np.inf))


@pytest.fixture(scope="module")
def random_engine(constraints, tokenizer_info):
    cfg = LlamaConfig(vocab=tokenizer_info.vocab_size, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp_dim=48,
                      rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True)
    buckets = Buckets(tokens=(2, 4, 8, 16), pairs=(0, 16, 64), max_rows=8, max_pages=24)
    return Engine(Llama(cfg, rngs=nnx.Rngs(3)), buckets, PAGE_SIZE, 40, salt=0, constraints=constraints)


def test_sampled_outputs_match_their_constraints_through_overlap_preemption_and_the_prefix_cache(random_engine, tokenizer_info):
    """Twelve constrained requests (three schemas, a regex, a choice; greedy and seeded) beside
    unconstrained ones, in a step budget that chunks prompts, a page pool small enough to preempt,
    the prefix cache on and overlap: each output that ends on EOS is a whole match (JSON that
    validates), and one cut by its token limit is a prefix the matcher accepts."""
    tok = tokenizer_info.tokenizer
    prompt = tok.encode("Answer in JSON about a person:")  # shared: the prefix cache serves it to later requests
    asked = [(Constraint("json_schema", json.dumps(schema)), schema) for schema in SCHEMAS]
    asked += [(Constraint("regex", r"\d{3}-\d{4}"), None), (grammar.from_choice(["alpha", "beta", "gamma"]), None)]
    requests, checks = [], {}
    for i in range(12):
        constraint, schema = asked[i % len(asked)]
        temperature = 0.0 if i < len(asked) else 1.0
        s = SamplingParams(max_new_tokens=60, temperature=temperature, seed=i, stop_token_ids=(EOS,), constraint=constraint)
        requests.append((f"c{i}", prompt + [i + 100], s))
        checks[f"c{i}"] = (constraint, schema)
    for i in range(4):
        requests.append((f"u{i}", prompt[:3] + [i + 7], SamplingParams(max_new_tokens=20, temperature=1.0, seed=i)))
    driver = Driver(random_engine, PAGE_SIZE, 40, 16, 8, overlap=True, prefix_cache=True)
    traces = driver.run(requests)
    assert sum(step.seqs[0].follows for step in driver.steps if step.seqs) > 10  # overlap ran
    ended = 0
    for rid, (constraint, schema) in checks.items():
        tokens = traces[rid].tokens
        matcher = llguidance.LLMatcher(random_engine.constraints.tokenizer, grammar.grammar(constraint))
        assert matcher.validate_tokens(tokens) == len(tokens), (rid, tok.decode(tokens))
        if tokens[-1] == EOS:
            ended += 1
            text = tok.decode(tokens[:-1])
            if schema is not None:
                jsonschema.validate(json.loads(text), schema)
            elif constraint.kind == "regex":
                assert len(text) == 8 and text[3] == "-" and text.replace("-", "").isdigit()
            else:
                assert text in ("alpha", "beta", "gamma")
    assert ended >= 8, ended


class _Point(pydantic.BaseModel):
    x: int
    y: int


class _Shape(pydantic.BaseModel):
    kind: Literal["polygon", "line"]
    points: list[_Point] = pydantic.Field(max_length=3)
    label: str | None = pydantic.Field(default=None, max_length=5)


MORE_SCHEMAS = [
    _Shape.model_json_schema(),  # $defs and $ref, an optional field, a nullable one, a literal
    {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"], "additionalProperties": False},
               {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}]},
    {"type": "object", "properties": {"v": {"const": "fixed"}, "n": {"enum": [1, 2.5, None]}, "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}},
     "required": ["v", "n", "code"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": -1, "maximum": 1}, "ok": {"type": "boolean"}},
     "required": ["score", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}},
                                "required": ["id"], "additionalProperties": False}, "minItems": 2, "maxItems": 2},
]


def test_many_schemas_and_seeds_validate(random_engine, tokenizer_info):
    """Every schema of SCHEMAS and MORE_SCHEMAS under four seeds, sampled at temperature 1 by the
    random model: each output that ends on EOS is JSON valid under its schema, and most do."""
    tok = tokenizer_info.tokenizer
    prompt = tok.encode("JSON:")
    requests, schema_of = [], {}
    for i, schema in enumerate(SCHEMAS + MORE_SCHEMAS):
        for seed in range(4):
            rid = f"s{i}-{seed}"
            schema_of[rid] = schema
            s = SamplingParams(max_new_tokens=80, temperature=1.0, seed=seed, stop_token_ids=(EOS,),
                               constraint=Constraint("json_schema", json.dumps(schema)))
            requests.append((rid, prompt + [seed + 50], s))
    traces = Driver(random_engine, PAGE_SIZE, 40, 16, 8, overlap=True, prefix_cache=True).run(requests)
    ended = 0
    for rid, schema in schema_of.items():
        tokens = traces[rid].tokens
        if tokens[-1] == EOS:
            ended += 1
            jsonschema.validate(json.loads(tok.decode(tokens[:-1])), schema)
    assert ended >= 0.75 * len(schema_of), ended
