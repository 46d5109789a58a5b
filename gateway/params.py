"""Reading and validating request bodies' fields. Every problem is an ApiError(400) naming the field.

A body reaches these readers already checked as a whole (gateway/body.py: its depth, every integer
within int64, every float finite, every string Unicode). `read` reads a field of the table
(gateway/fields.py): its kind, its spellings, its range or choices, its default; the readers below
it read what the table names them for (prompts, messages, stop lists, logit bias), with the counts
and lengths `server.max_*` bound (a ServerConfig, `limits`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import regex

from gateway import fields
from gateway.errors import ApiError, invalid
from gateway.fields import (
    ADD_GENERATION_PROMPT, CHAT, CONTINUE_FINAL_MESSAGE, CONTINUOUS_USAGE_STATS, DEFAULT, INCLUDE_USAGE, MAX_TOKEN_ID, N, PROMPT_LOGPROBS,
    RETURN_ROUTED_EXPERTS, ROUTED_EXPERTS_START_LEN, STOP_REGEX, STREAM, STREAM_OPTIONS_FIELD, TRUNCATE_PROMPT_TOKENS, TRUNCATION_SIDE,
    Field,
)
from jaxstream.config import LOGPROBS_MODES, ServerConfig
from jaxstream.english import listed
from jaxstream.protocol import MAX_TOKEN_IDS_LOGPROB, ChatMessage, Constraint, SamplingParams

_MISSING = object()
MAX_CHOICES = 128  # n x prompts in one request
ID_RANGE = f"integers in 0..{MAX_TOKEN_ID}"


JSON_KINDS = {float: "a number", int: "an integer", bool: "a boolean", str: "a string", list: "an array", dict: "an object",
              type(None): "null"}  # as a message names a JSON value's kind


def get(body: dict, name: str, kind: type | tuple[type, ...], default: Any = None, *, prefix: str = "") -> Any:
    """`body[name]` checked against `kind` (None means "use the default")."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(JSON_KINDS[k] for k in kinds)
        raise invalid(f"'{prefix}{name}' must be {names}, got {JSON_KINDS[type(value)]}", prefix + name, "invalid_type")
    return value


def read(body: dict, field: Field, *, prefix: str = "") -> Any:
    """`field`'s value in `body`: under the first of its spellings the body gives (a flag is set
    when any spelling sets it: vLLM's include_stop_str_in_output is SGLang's no_stop_trim), checked
    against its kinds, then its range or choices; its default when no spelling gives it. A wrong
    kind is refused naming the spelling given, a value out of range naming the field."""
    value = None
    for spelling in field.spellings:
        given = get(body, spelling, field.kind, prefix=prefix)
        if given is not None:
            value = given
            if given is not False:
                break
    if value is None:
        return field.default
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        check(within(field, value), prefix + field.name, f"must be {stated(field)}, got {value}")
    elif field.choices:
        check(value in field.choices, prefix + field.name, one_of(field.choices, value))
    return value


def within(field: Field, value: float) -> bool:
    """Whether `value` is in `field`'s range, or is the value outside it that the field takes too."""
    if field.sentinel is not None and value == field.sentinel[0]:
        return True
    low, high = field.minimum, field.maximum
    above = low is None or (value > low if field.open_minimum else value >= low)
    return above and (high is None or value <= high)


def stated(field: Field) -> str:
    """A field's range as its refusal states it: "in (0, 1]", "-1 (off) or in 0..2147483647"."""
    if field.range_says:
        return field.range_says
    low, high = field.minimum, field.maximum
    if low is None:
        span = f"<= {high}"
    elif high is None:
        span = f"{'>' if field.open_minimum else '>='} {low}"
    elif field.kind == (int,):
        span = f"in {low}..{high}"
    else:
        span = f"in {'(' if field.open_minimum else '['}{low}, {high}]"
    if field.sentinel is None:
        return span
    value, means = field.sentinel
    return f"{value} ({means}) or {span}" if means else f"{value} or {span}"


def one_of(choices: tuple[str, ...], value: object) -> str:
    """The refusal of a value not among `choices`, in the words clients match."""
    if len(choices) == 2:
        return f"must be {json.dumps(choices[0])} or {json.dumps(choices[1])}, got {json.dumps(value)}"
    return f"must be one of {', '.join(choices)}; got {json.dumps(value)}"


def check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise invalid(f"'{name}' {message}", name)


def string_list(body: dict, name: str, *, prefix: str = "") -> tuple[str, ...]:
    value = get(body, name, (str, list), prefix=prefix)
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    check(all(isinstance(s, str) and s for s in items), prefix + name, "must be a non-empty string or a list of them")
    return tuple(items)


def empty_prompt(name: str) -> ApiError:
    """A prompt with nothing in it, in vLLM's words (its clients match them), naming the field."""
    return invalid(f"The decoder prompt cannot be empty: '{name}' is empty", name)


def is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID


def token_ids(value: object, name: str) -> tuple[int, ...]:
    """A prompt given as token ids: a non-empty list of them (the tokenizer checks they are in the
    vocabulary)."""
    if value == []:
        raise empty_prompt(name)
    check(isinstance(value, list) and all(map(is_token_id, value)), name, f"must be a non-empty list of token ids ({ID_RANGE})")
    return tuple(value)


def int_list(body: dict, name: str, *, prefix: str = "", most: int | None = None) -> tuple[int, ...]:
    """A list of token ids, at most `most` of them (the tokenizer checks they are in the vocabulary)."""
    value = get(body, name, list, prefix=prefix) or []
    check(all(map(is_token_id, value)), prefix + name, f"must be a list of token ids ({ID_RANGE})")
    check(most is None or len(value) <= most, prefix + name, f"takes at most {most} token ids, got {len(value)}")
    return tuple(value)


def stop_strings(body: dict, limits: ServerConfig, *, prefix: str = "") -> tuple[str, ...]:
    """`stop`: a string or a list of them, their number and length bounded (the detokenizer searches
    each after every token, and holds back the longest one's length of text while streaming)."""
    name = prefix + "stop"
    stops = string_list(body, "stop", prefix=prefix)
    check(len(stops) <= limits.max_stop_strings, name,
          f"takes at most {limits.max_stop_strings} strings (server.max_stop_strings), got {len(stops)}")
    longest = max(map(len, stops), default=0)
    check(longest <= limits.max_stop_string_chars, name,
          f"strings are at most {limits.max_stop_string_chars} characters long (server.max_stop_string_chars), got one of {longest}")
    return stops


@dataclass(frozen=True)
class Returns:
    """What a client wants back besides text: logprob options that ride in SamplingParams."""

    top_logprobs: int = 0  # alternatives per token
    prompt_logprobs_from: int = -1  # -1: no prompt logprobs
    texts: bool = False  # each returned token's text
    mode: str | None = None  # logprobs_mode; None: the server's default (server.logprobs_mode)
    routed_experts: bool = False  # SGLang's return_routed_experts (gateway/experts.py)
    routed_experts_start_len: int = 0
    prompt_ids: bool = False  # the prompt's token ids (vLLM's return_token_ids)
    prompt_top_logprobs: int = -1  # alternatives per prompt position; -1: top_logprobs
    token_ids_logprob: tuple[int, ...] = ()  # SGLang's: these ids' logprobs at every position returned


def prompt_logprobs_count(body: dict) -> int | None:
    """vLLM's prompt_logprobs: alternatives per prompt position (None: no prompt logprobs; -1: the
    whole vocabulary, which gateway/logprob_counts.py resolves, checking the server's cap)."""
    return read(body, PROMPT_LOGPROBS)


def token_ids_logprob(body: dict, name: str = "token_ids_logprob") -> tuple[int, ...]:
    """SGLang's token_ids_logprob (or a route's own name for it): a list of token ids, at most
    MAX_TOKEN_IDS_LOGPROB distinct ones (the device gathers that many per row); repeats dropped,
    first ones kept in order. The tokenizer checks them against the vocabulary."""
    ids = tuple(dict.fromkeys(int_list(body, name)))
    check(len(ids) <= MAX_TOKEN_IDS_LOGPROB, name, f"must name at most {MAX_TOKEN_IDS_LOGPROB} distinct token ids, got {len(ids)}")
    return ids


def routed_experts_returns(body: dict, returns: Returns) -> Returns:
    """`returns` with the request's top-level return_routed_experts and routed_experts_start_len
    (>= 0 here; the tokenizer checks it against the prompt's length)."""
    return replace(returns, routed_experts=read(body, RETURN_ROUTED_EXPERTS),
                   routed_experts_start_len=read(body, ROUTED_EXPERTS_START_LEN))


def sampling_params(body: dict, max_tokens: int | None, returns: Returns = Returns(), *, where: str = CHAT,
                    mode_default: str = "sampling", prefix: str = "", max_tokens_name: str = "max_tokens",
                    constraint: Constraint | None = None, limits: ServerConfig = ServerConfig()) -> SamplingParams:
    """The sampling fields of a body of kind `where` (gateway/fields.py): the OpenAI routes' at
    the top level, /generate's in `sampling_params`; `max_tokens` is the client's, read with its
    route's row (named `max_tokens_name`, prefix included, in messages).
    `constraint`: what the output must match, as the route's dialect reads it (gateway/constraints.py).
    `limits`: the server's bounds on the counts and lengths of stop strings, stop ids and logit bias."""
    # Every row of the table (as it is now) that fills SamplingParams and reads as a plain value;
    # the others below
    plain = [row for row in fields.FIELDS if row.fills and not row.reader and where in row.bodies]
    given = {row.fills: read(body, row, prefix=prefix) for row in plain}
    if given.get("top_k") == 0:  # 0 is off too (vLLM's); the device knows -1 alone
        given["top_k"] = -1
    min_tokens = given.get("min_new_tokens", DEFAULT.min_new_tokens)
    check(max_tokens is None or min_tokens <= max_tokens, prefix + "min_tokens",
          f"({min_tokens}) must not exceed {max_tokens_name} ({max_tokens})")
    # the request's own mode, else /generate's top-level one, else the server's
    mode = next(m for m in (get(body, "logprobs_mode", str, None, prefix=prefix), returns.mode, mode_default) if m is not None)
    check(mode in LOGPROBS_MODES, prefix + "logprobs_mode", one_of(LOGPROBS_MODES, mode))
    return SamplingParams(
        **given,
        max_new_tokens=max_tokens,
        stop=stop_strings(body, limits, prefix=prefix),
        stop_regex=stop_patterns(body, prefix=prefix),
        stop_token_ids=int_list(body, "stop_token_ids", prefix=prefix, most=limits.max_stop_token_ids),
        logit_bias=logit_bias(body, prefix=prefix, most=limits.max_logit_bias),
        top_logprobs=returns.top_logprobs,
        prompt_logprobs_from=returns.prompt_logprobs_from,
        allowed_token_ids=allowed_token_ids(body, prefix=prefix),
        raw_logprobs=mode == "raw",
        processed_logprobs=mode == "processed",
        token_ids_logprob=returns.token_ids_logprob,
        return_routed_experts=returns.routed_experts,
        routed_experts_start_len=returns.routed_experts_start_len if returns.routed_experts else 0,
        logprob_texts=returns.texts,
        return_prompt_token_ids=returns.prompt_ids,
        prompt_top_logprobs=returns.prompt_top_logprobs,
        constraint=constraint,
    )


MAX_STOP_PATTERN_CHARS = 1024


def stop_patterns(body: dict, *, prefix: str = "") -> tuple[str, ...]:
    """SGLang's stop_regex: a Python regular expression or a list of them, compiled here so a bad
    one is the client's 400 (the regex module's reason) rather than the detokenizer's failure. The detokenizer
    searches each over the output after every token: their number and size are bounded."""
    name = prefix + "stop_regex"
    patterns = string_list(body, "stop_regex", prefix=prefix)
    check(len(patterns) <= STOP_REGEX.max_items, name, f"takes at most {STOP_REGEX.max_items} patterns, got {len(patterns)}")
    for pattern in patterns:
        check(len(pattern) <= MAX_STOP_PATTERN_CHARS, name, f"patterns are at most {MAX_STOP_PATTERN_CHARS} characters long")
        try:
            regex.compile(pattern)  # as the detokenizer searches it: Python's re syntax, and a time limit
        except (regex.error, OverflowError, RecursionError) as exc:  # too deep or too large, too
            raise invalid(f"'{name}' has an invalid regular expression {json.dumps(pattern)}: {exc}", name) from None
    return patterns


def custom_params(body: dict, *, prefix: str = "") -> None:
    """SGLang's `custom_params`: arguments for a custom logit processor (sampling_params.py's
    CustomParamValue: an object of JSON scalars, or lists or objects of them). Accepted as SGLang
    accepts it, and read by nothing here: the one reader, `custom_logit_processor`, is refused
    (NOT_YET). slime sends `{"return_top_p_token_ids": true}` whenever its top_p is below 1."""
    value = get(body, "custom_params", dict, None, prefix=prefix)
    scalar = (type(None), bool, int, float, str)
    bad = [json.dumps(key) for key, v in (value or {}).items()
           if not (isinstance(v, scalar) or isinstance(v, list) and all(isinstance(i, scalar) for i in v)
                   or isinstance(v, dict) and all(isinstance(i, scalar) for i in v.values()))]
    check(not bad, prefix + "custom_params", f"values must be JSON scalars, or lists or objects of them; {listed(bad)} nest deeper")


def allowed_token_ids(body: dict, *, prefix: str = "") -> tuple[int, ...]:
    """vLLM's allowed_token_ids: the only ids that may be sampled; the tokenizer checks they exist."""
    ids = int_list(body, "allowed_token_ids", prefix=prefix)
    check(ids or body.get("allowed_token_ids") is None, prefix + "allowed_token_ids",
          "must not be empty: it would leave no token to sample")
    return tuple(dict.fromkeys(ids))


def logit_bias(body: dict, *, prefix: str = "", most: int = ServerConfig.max_logit_bias) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}, bias in [-100, 100], at most `most` entries; the tokenizer
    checks the ids exist. A refusal names every bad key (or value), not only the first."""
    name = f"{prefix}logit_bias"
    biases = get(body, "logit_bias", dict, {}, prefix=prefix)
    check(len(biases) <= most, name, f"takes at most {most} entries (server.max_logit_bias), got {len(biases)}")
    # a key's length first: int() of a key of thousands of digits is slow, or refused by Python
    bad_keys = [json.dumps(key) for key in biases if not (re.fullmatch(r"[0-9]{1,10}", key) and int(key) <= MAX_TOKEN_ID)]
    check(not bad_keys, name, f"keys must be token ids ({ID_RANGE} as strings), got {listed(bad_keys)}")
    bad_values = [f"{json.dumps(bias)} for token {key}" for key, bias in biases.items()
                  if not (isinstance(bias, (int, float)) and not isinstance(bias, bool) and -100 <= bias <= 100)]
    check(not bad_values, name, f"values must be numbers in [-100, 100], got {listed(bad_values)}")
    return tuple(sorted({int(key): float(bias) for key, bias in biases.items()}.items()))


def choices_count(body: dict, prompts: int, *, prefix: str = "") -> int:
    """`n`, bounded so one request cannot flood the pipeline."""
    n = read(body, N, prefix=prefix)
    check(n * prompts <= MAX_CHOICES, prefix + "n", f"n ({n}) times the number of prompts ({prompts}) must be at most {MAX_CHOICES}")
    return n


def seeded(sampling: SamplingParams, choice: int) -> SamplingParams:
    """The j-th of n samples of one prompt: a given seed becomes seed + j, so the n samples differ
    yet the whole response is reproducible (draws are keyed by seed and position)."""
    if sampling.seed is None or choice == 0:
        return sampling
    return msgspec.structs.replace(sampling, seed=sampling.seed + choice)


def _asks(v: object) -> bool:
    """Whether a field's value asks for something (not absent, null, false, empty or zero)."""
    return v not in (None, False, "", [], {}, 0)


def holds_media(v: object) -> bool:
    """SGLang's rule for `image_data`, `video_data`, `audio_data` (mm_utils.has_valid_data): null,
    and a list whose nested lists hold only nulls or nothing, give no input; anything else does.
    AReaL sends `"image_data": []` with every text rollout."""
    if isinstance(v, list):
        return any(map(holds_media, v))
    return v is not None


# The peers' fields (OpenAI's, vLLM's, SGLang's) whose meaning we do not implement: refused, never
# silently ignored, when their value asks for something (an unknown field, as vLLM, is ignored).
# Constrained decoding's fields are read, or refused, by gateway/constraints.py.
# Per field: whether the value asks for it, and what it asks for (the refusal names that, never
# echoes the value).
NOT_YET = {
    "best_of": (lambda v: v not in (None, 1), "best_of above 1"),
    "suffix": (lambda v: v not in (None, ""), "a suffix (insertion)"),
    # OpenAI's deprecated spelling of tools (gateway/tools.py serves `tools` and `tool_choice`)
    "functions": (lambda v: v is not None, "function calling through 'functions' (send 'tools')"),
    "function_call": (lambda v: v not in (None, "none"), "function calling through 'function_call' (send 'tool_choice')"),
    # Not built, on purpose (docs/api.md, Beam search): beams fork each step, sharing the parent's KV
    # pages (its partial last page copied), and are chosen by cumulative logprob across beams before
    # the next step is planned; the scheduler plans step N + 1 before step N's result and gives a
    # page to exactly one request or the cache.
    "use_beam_search": (lambda v: v not in (None, False),
                        "beam search (each step would fork beams sharing KV pages and rank them by cumulative logprob before "
                        "planning the next, which the overlapped scheduler cannot: see docs/api.md)"),
    "return_hidden_states": (lambda v: v not in (None, False), "returning hidden states"),
    "image_data": (holds_media, "image input"),
    # vLLM's
    "bad_words": (_asks, "bad words"),
    "length_penalty": (lambda v: v not in (None, 1, 1.0), "a length penalty (beam search)"),
    "prompt_embeds": (_asks, "prompt embeddings"),
    "cache_salt": (_asks, "prefix cache isolation (cache_salt)"),
    "kv_transfer_params": (_asks, "KV transfer"),
    "vllm_xargs": (_asks, "extra engine arguments"),
    "priority": (_asks, "request priorities"),
    "logits_processors": (_asks, "custom logits processors"),
    "chat_template": (_asks, "a request's own chat template"),
    "documents": (_asks, "documents for the chat template"),
    "mm_processor_kwargs": (_asks, "multimodal input"),
    "thinking_token_budget": (_asks, "a thinking token budget"),
    # SGLang's
    "custom_logit_processor": (_asks, "custom logits processors"),
    "session_params": (_asks, "sessions"),
    "input_embeds": (_asks, "input embeddings"),
    "video_data": (holds_media, "video input"),
    "audio_data": (holds_media, "audio input"),
    "return_entropy": (_asks, "returning entropies"),
    "routed_dp_rank": (_asks, "choosing the data-parallel rank"),
    "data_parallel_rank": (_asks, "choosing the data-parallel rank"),
    # OpenAI's
    "audio": (_asks, "audio output"),
    "modalities": (lambda v: v not in (None, ["text"]), "output modalities other than text"),
    "prediction": (_asks, "predicted outputs"),
    "web_search_options": (_asks, "web search"),
    "reasoning_effort": (_asks, "reasoning effort"),
}


def refuse_unsupported(body: dict, *, prefix: str = "", table: dict | None = None) -> None:
    """A 400 naming the first field of `table` (NOT_YET by default) whose value asks for what is not built."""
    for name, (used, what) in (NOT_YET if table is None else table).items():
        if name in body and used(body[name]):
            raise invalid(f"{what} ('{prefix}{name}') is not supported by this server yet", prefix + name)


def continuous_usage(body: dict) -> bool:
    """vLLM's stream_options.continuous_usage_stats: usage so far in every chunk (with include_usage, as vLLM)."""
    options = read(body, STREAM_OPTIONS_FIELD) or {}
    return read(options, CONTINUOUS_USAGE_STATS, prefix="stream_options.")


def truncation(body: dict) -> dict:
    """vLLM's truncate_prompt_tokens (keep k of the prompt's tokens; -1: as many as the context
    holds) and truncation_side (which end is kept: "left" truncates the start, the default) as
    GenerateRequest's fields."""
    return {"truncate_prompt_tokens": read(body, TRUNCATE_PROMPT_TOKENS), "truncate_left": read(body, TRUNCATION_SIDE) == "left"}


def chat_continuation(body: dict, messages: tuple[ChatMessage, ...]) -> dict:
    """How the chat template ends the prompt: a new assistant turn (add_generation_prompt), or the
    last message left open for the model to continue (continue_final_message). A chat that ends
    with the assistant's message continues it (SGLang's assistant prefill) unless the client asks
    for a new turn."""
    add = read(body, ADD_GENERATION_PROMPT)
    keep_open = read(body, CONTINUE_FINAL_MESSAGE)
    if add and keep_open:
        raise invalid("Cannot set both `continue_final_message` and `add_generation_prompt` to True.", "continue_final_message")
    if keep_open is None:
        keep_open = messages[-1].role == "assistant" and not add
    return {"add_generation_prompt": not keep_open if add is None else add, "continue_final_message": keep_open}


def stream_flags(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = read(body, STREAM)
    options = read(body, STREAM_OPTIONS_FIELD)
    if options is not None and not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return stream, read(options or {}, INCLUDE_USAGE, prefix="stream_options.")
