"""Detokenizer core: incremental decode, stop strings, per-request finish (reliability promise 5, T-12).

Uses the real SmolLM2 tokenizer (byte-level BPE) from the bundled GGUF; no JAX, no Redis.
"""

from __future__ import annotations

import random

import pytest

from detokenizer_svc.incremental import IncrementalDetokenizer
from detokenizer_svc.request import DetokRequest
from detokenizer_svc.stops import StopMatcher
from jaxstream.config import ModelConfig
from jaxstream.model_files import load_tokenizer
from jaxstream.protocol import FinishReason, RequestStart

MULTIBYTE = "héllo 世界 🙂 naïve café ☕"
WINDOW_BOUND = 10  # 2 * (MAX_PENDING + 1): sent context plus unsent tokens, one token per push


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig()).tokenizer


@pytest.fixture(scope="module")
def partial_ids(tok):
    """Ids whose piece is not whole UTF-8 (part of a character, or a lone continuation byte)."""
    return [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(tok, ids: list[int], skip: bool = True) -> tuple[list[str], str, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = [detok.push([i]) for i in ids]
    return deltas, detok.finish(), detok


def start(**kw) -> RequestStart:
    fields = dict(
        rid="r1",
        gateway="g",
        prompt_tokens=7,
        stop=(),
        stop_token_ids=(),
        max_new_tokens=1000,
        min_new_tokens=0,
        skip_special_tokens=True,
    )
    return RequestStart(**(fields | kw))


def run(req: DetokRequest, ids: list[int]) -> list:
    return [req.on_tokens([i], [-0.5]) for i in ids]


def text_of(outputs) -> str:
    return "".join(o.text for o in outputs if o is not None)


# --- IncrementalDetokenizer ----------------------------------------------------------------


def test_multibyte_text_streams_whole_characters(tok):
    ids = encode(tok, MULTIBYTE)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the text really splits characters
    deltas, tail, _ = stream(tok, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # something was held back
    assert "".join(deltas) == MULTIBYTE and tail == ""


def test_special_tokens_skipped_or_kept(tok):
    ids = [1] + encode(tok, "hi 世") + [2]
    skipped, tail, _ = stream(tok, ids, skip=True)
    assert "".join(skipped) + tail == "hi 世"
    kept, tail, _ = stream(tok, ids, skip=False)
    assert "".join(kept) + tail == "<|im_start|>hi 世<|im_end|>"


def test_skipped_special_tokens_inside_a_character(tok):
    ids = encode(tok, "世")  # two tokens, neither whole
    assert len(ids) == 2
    deltas, tail, _ = stream(tok, [ids[0]] + [0] * 8 + [ids[1]], skip=True)
    assert deltas[-1] == "世" and "".join(deltas[:-1]) == "" and tail == ""


def test_finish_emits_unfinished_character_as_decode_does(tok):
    ids = encode(tok, "ok 世")[:-1]
    deltas, tail, _ = stream(tok, ids)
    assert "".join(deltas) == "ok "
    assert tail == "\ufffd" == tok.decode(ids)[-1]


def test_run_of_invalid_bytes_keeps_flowing_in_a_bounded_window(tok, partial_ids):
    lone = next(i for i in partial_ids if tok.decode([i, i]) == "\ufffd\ufffd")  # a continuation byte
    deltas, tail, detok = stream(tok, [lone] * 1000)
    assert "".join(deltas) + tail == "\ufffd" * 1000
    assert len(tail) <= 5  # held back only a few, not the whole run
    assert detok.max_window <= WINDOW_BOUND


def test_long_text_decodes_in_a_bounded_window(tok):
    ids = encode(tok, (MULTIBYTE + " and some plain English words. ") * 100)
    deltas, tail, detok = stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids)
    assert len(ids) > 1000 and detok.max_window <= WINDOW_BOUND


@pytest.mark.parametrize("skip", [True, False])
def test_random_sequences_concatenate_to_full_decode(tok, partial_ids, skip):
    """T-12: 300 random sequences mixing ordinary, partial-character and special ids."""
    for seed in range(300):
        rng = random.Random(seed)

        def pick() -> int:
            roll = rng.random()
            if roll < 0.5:
                return rng.choice(partial_ids)
            return rng.randrange(17) if roll < 0.6 else rng.randrange(len(tok))

        ids = [pick() for _ in range(rng.randint(1, 60))]
        deltas, tail, detok = stream(tok, ids, skip)
        full = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) + tail == full, (seed, ids)
        assert detok.max_window <= WINDOW_BOUND, (seed, ids)


# --- StopMatcher ---------------------------------------------------------------------------


def push_all(matcher: StopMatcher, chunks: list[str]) -> tuple[str, str | None]:
    sent = []
    for chunk in chunks:
        text, matched = matcher.push(chunk)
        sent.append(text)
        if matched is not None:
            return "".join(sent), matched
    return "".join(sent), None


def test_stop_string_across_pushes():
    m = StopMatcher(("o w",))
    assert m.push("hel") == ("hel", None)
    assert m.push("lo") == ("l", None)  # "o" could start "o w"
    assert m.push(" ") == ("", None)
    assert m.push("world") == ("", "o w")
    assert m.finish() == ""


def test_stop_string_at_start():
    assert StopMatcher(("Hi",)).push("Hi there") == ("", "Hi")


def test_self_overlapping_stop_string():
    # "aab" inside "aaab": the held tail must be the longest possible stop prefix
    assert push_all(StopMatcher(("aab",)), list("aaab")) == ("a", "aab")


def test_later_starting_stop_completing_first_wins():
    # Chosen rule: stop as soon as any stop string completes (as vLLM and SGLang do).
    assert push_all(StopMatcher(("abcde", "cd")), ["ab", "c", "d", "e"]) == ("ab", "cd")


def test_earliest_start_wins_within_one_push():
    assert push_all(StopMatcher(("abcde", "cd")), ["abcdef"]) == ("", "abcde")
    assert push_all(StopMatcher(("abc", "ab")), ["xabc"]) == ("x", "ab")  # same start: shorter


def test_held_text_released_by_finish():
    m = StopMatcher(("xyz", ""))  # the empty stop string is ignored
    assert m.push("abx") == ("ab", None)
    assert m.push("y") == ("", None)
    assert m.finish() == "xy"


# --- DetokRequest --------------------------------------------------------------------------


def test_request_stop_string_across_tokens(tok):
    ids = encode(tok, "Hello world, this is a test of stop strings.")
    stop = "is a te"
    assert not any(stop in tok.decode([i]) for i in ids)  # no single token holds it
    req = DetokRequest(start(stop=(stop,)), tok)
    outs = run(req, ids)
    last = next(o for o in outs if o is not None and o.finish is not None)
    assert last.finish == FinishReason("stop", matched=stop)
    assert req.stopped_by_string and req.finished
    assert text_of(outs) == "Hello world, this "
    n = outs.index(last) + 1
    assert last.completion_tokens == n and outs[n:] == [None] * (len(ids) - n)  # later tokens ignored
    assert n < len(ids)
    assert last.prompt_tokens == 7 and last.logprobs == (-0.5,)


def test_request_stop_string_at_start(tok):
    ids = encode(tok, "Hello there")
    req = DetokRequest(start(stop=("Hello",)), tok)
    out = req.on_tokens(ids[:1], [-1.0])
    assert out.text == "" and out.finish == FinishReason("stop", matched="Hello")
    assert out.token_ids == (ids[0],)  # the token that produced the match is reported


def test_request_length_flushes_held_text(tok):
    ids = encode(tok, "Hello wor") + encode(tok, "世")[:1]
    req = DetokRequest(start(stop=("world",), max_new_tokens=len(ids)), tok)
    outs = run(req, ids)
    assert outs[-1].finish == FinishReason("length", length=len(ids))
    assert outs[-1].text == "wor\ufffd"  # a possible stop prefix and a partial character
    assert text_of(outs) == tok.decode(ids) and not req.stopped_by_string


def test_request_stop_token(tok):
    head = encode(tok, "hi 世界") + [2]
    req = DetokRequest(start(stop_token_ids=(2,)), tok)
    outs = run(req, head + encode(tok, "more"))
    finished = [o for o in outs if o is not None and o.finish is not None]
    assert [o.finish for o in finished] == [FinishReason("stop", matched=2)]
    assert text_of(outs) == "hi 世界"  # the special stop token's text is skipped
    assert finished[0].completion_tokens == len(head) and finished[0].token_ids == (2,)
    assert not req.stopped_by_string


def test_request_stop_token_kept_when_not_skipping(tok):
    req = DetokRequest(start(stop_token_ids=(2,), skip_special_tokens=False), tok)
    outs = run(req, encode(tok, "hi") + [2])
    assert text_of(outs) == "hi<|im_end|>" and outs[-1].finish.matched == 2


def test_min_new_tokens_ignores_early_stop_token_and_string(tok):
    a = encode(tok, "a")
    req = DetokRequest(start(stop=("a",), stop_token_ids=(2,), min_new_tokens=3), tok)
    outs = run(req, [2, *a, 2])
    assert [o.finish for o in outs] == [None, None, FinishReason("stop", matched=2)]
    assert text_of(outs) == "a"


def test_one_call_with_several_tokens_stops_at_the_finishing_one(tok):
    ids = encode(tok, "one two")
    req = DetokRequest(start(stop_token_ids=(2,)), tok)
    out = req.on_tokens([*ids, 2, *ids], [-0.1] * (2 * len(ids) + 1))
    assert out.token_ids == (*ids, 2) and len(out.logprobs) == len(ids) + 1
    assert out.text == "one two" and out.completion_tokens == len(ids) + 1


def test_end_flushes_held_text_with_given_finish(tok):
    ids = encode(tok, "abc x")
    req = DetokRequest(start(stop=("x y",)), tok)
    outs = run(req, ids)
    assert text_of(outs) == "abc "
    final = req.end(FinishReason("abort", message="client gone"))
    assert final.text == "x" and final.finish.type == "abort" and final.token_ids == ()
    assert final.completion_tokens == len(ids)
    assert req.on_tokens(ids, [0.0] * len(ids)) is None and req.end(FinishReason("abort")) is None
