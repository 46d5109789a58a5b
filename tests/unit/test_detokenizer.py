"""Detokenizer core: incremental decode, stop strings, per-request finish (reliability promise 5, T-12),
and the logprob extras: token texts, top alternatives, prompt logprobs.

Uses the real SmolLM2 tokenizer (byte-level BPE) from the bundled GGUF; no JAX, no Redis.
"""

from __future__ import annotations

import math
import random
import re

import msgspec
import numpy as np
import pytest

from detokenizer_svc.incremental import IncrementalDetokenizer
from detokenizer_svc.request import DetokRequest
from detokenizer_svc.service import Detokenizer
from detokenizer_svc.stops import StopMatcher, reach
from detokenizer_svc.token_text import TokenTexts, is_byte_level
from jaxstream.arrays import from_wire, to_wire
from jaxstream.config import ModelConfig
from jaxstream.model_files import load_tokenizer
from jaxstream.protocol import (
    CacheHit, FinishReason, FinishRule, GatewayInput, OutputBatch, PromptScores, RequestEnd, RequestEvents, RequestStart, RoutedExperts,
    StepResult, TokenLogprob, WorkerOutput,
)
from tests.worker.driver import wire

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


def start(stop_token_ids=(), max_new_tokens=1000, min_new_tokens=0, **kw) -> RequestStart:
    fields = dict(rid="r1", gateway="g", prompt_tokens=7, stop=(), skip_special_tokens=True,
                  finish=FinishRule(stop_token_ids, max_new_tokens, min_new_tokens))
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


def test_stop_pattern_streams_unheld_and_keeps_its_match():
    # SGLang's stop_regex: nothing held back, the match stays, text after it in the push goes
    m = StopMatcher((), (r"\d+ apples",))
    assert m.push("I have 1") == ("I have 1", None)
    assert m.push("2 app") == ("2 app", None)
    assert m.push("les and pears") == ("les", r"\d+ apples")
    assert m.finish() == ""


def test_stop_pattern_searches_the_whole_output():
    # anchors see the output, not the push: ^ its start, $ its end so far
    assert push_all(StopMatcher((), ("^Hello",)), ["Hel", "lo world"]) == ("Hello", "^Hello")
    assert push_all(StopMatcher((), ("^world",)), ["Hello ", "world"]) == ("Hello world", None)
    assert push_all(StopMatcher((), (r"[.!?]\s*$",)), ["Hi", ".", " More"]) == ("Hi.", r"[.!?]\s*$")


def test_stop_patterns_in_order_after_stop_strings():
    assert push_all(StopMatcher((), ("b+", "a")), ["xab"]) == ("xab", "b+")  # the first listed that matches
    assert push_all(StopMatcher(("ab",), ("a",)), ["xab"]) == ("x", "ab")  # stop strings first, as SGLang
    # a lookahead's match may end before the push: what was sent stays sent, nothing more goes
    assert push_all(StopMatcher((), ("a(?=b)",)), ["xa", "bc"]) == ("xa", "a(?=b)")


def test_stop_pattern_search_window_reaches_back_its_longest_match():
    # bounded patterns search from their longest match before the last search's end: same answers
    assert reach("abc") == 3 and reach(r"a{2,5}") == 5 and reach(r"\d+") >= 1 << 60 and reach("x(?=y)") >= 1 << 60
    assert push_all(StopMatcher((), (r"\d{3}",)), ["ab1", "2", "x", "45", "6 tail"]) == ("ab12x456", r"\d{3}")
    assert push_all(StopMatcher((), (r"\bend\b",)), ["the en", "ding", " en", "d."]) == ("the ending end", r"\bend\b")
    assert push_all(StopMatcher((), (r"ab$",)), ["xa", "bc", "a", "b"]) == ("xabcab", "ab$")


@pytest.mark.parametrize("pattern", [r"ab", r"a.b", r"\bba\b", r"b{2,3}$", r"(?:ab|ba)\s", r"(?<=a)b", r"^ba", r"a(?=b)"])
def test_stop_pattern_window_finds_what_a_whole_search_finds(pattern):
    rng = random.Random(pattern)
    for _ in range(300):
        chunks = ["".join(rng.choice("ab ") for _ in range(rng.randrange(0, 3))) for _ in range(8)]
        text, expected = "", None
        for chunk in chunks:  # the reference: the whole output searched after every push
            before, text = len(text), text + chunk
            if (match := re.search(pattern, text)) is not None:
                expected = (text[: max(match.end(), before)], pattern)
                break
        assert push_all(StopMatcher((), (pattern,)), chunks) == (expected or (text, None)), chunks


def test_stop_pattern_releases_held_stop_string_prefix():
    m = StopMatcher(("xyz",), ("q",))
    assert m.push("abx") == ("ab", None)
    assert m.push("q!") == ("xq", "q")  # the held "x" is output before the match


def test_stop_pattern_unchecked_text_is_still_searched_later():
    m = StopMatcher((), ("ab",))
    assert m.push("a", check=False) == ("a", None)
    assert m.push("b", check=False) == ("b", None)  # before min_new_tokens: no finish
    assert m.push("c") == ("", "ab")  # then the match already sent finishes the output


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


def test_no_stop_trim_keeps_the_matched_stop_string(tok):
    ids = encode(tok, "Hello world, this is a test of stop strings.")
    req = DetokRequest(start(stop=("is a te",), no_stop_trim=True), tok)
    outs = run(req, ids)
    assert text_of(outs) == "Hello world, this is a te"  # cut right after it, not before
    assert next(o for o in outs if o is not None and o.finish is not None).finish == FinishReason("stop", matched="is a te")


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


def test_request_stop_pattern_across_tokens(tok):
    ids = encode(tok, "Order 66 was given. Then more text follows.")
    req = DetokRequest(start(stop_regex=(r"\d+ was",)), tok)
    outs = run(req, ids)
    last = next(o for o in outs if o is not None and o.finish is not None)
    assert last.finish == FinishReason("stop", matched=r"\d+ was")
    assert req.stopped_by_string and text_of(outs) == "Order 66 was"
    assert outs[outs.index(last) + 1 :] == [None] * (len(ids) - outs.index(last) - 1)


def test_a_pattern_that_backtracks_catastrophically_ends_its_request_alone(tok):
    # (a|aa)+c over "aaa...a" backtracks exponentially; the time limit ends this request instead
    ids = encode(tok, "a" * 80)
    req = DetokRequest(start(stop_regex=(r"(a|aa)+c",)), tok)
    outs = run(req, ids)
    last = next(o for o in outs if o is not None and o.finish is not None)
    assert last.finish.type == "abort" and "(a|aa)+c" in last.finish.message and "ms to search" in last.finish.message
    assert req.stopped_by_string  # the scheduler is told to stop it, as for a stop string


def test_request_stop_token_beats_stop_pattern(tok):
    req = DetokRequest(start(stop_token_ids=(2,), stop_regex=("hi",)), tok)
    outs = run(req, encode(tok, "oh") + [2])
    assert outs[-1].finish == FinishReason("stop", matched=2) and not req.stopped_by_string


def test_prompt_ids_only_on_the_first_output_when_asked(tok):
    ids = encode(tok, "one two three")
    req = DetokRequest(start(prompt_ids=(5, 6, 7)), tok)
    outs = run(req, ids)
    assert outs[0].prompt_token_ids == (5, 6, 7) and all(o.prompt_token_ids == () for o in outs[1:])
    assert all(o.prompt_token_ids == () for o in run(DetokRequest(start(), tok), ids))
    aborted = DetokRequest(start(prompt_ids=(5,)), tok)  # ended before any token: its one output has them
    assert aborted.end(FinishReason("abort")).prompt_token_ids == (5,)


# --- Logprob extras: token texts, top alternatives, prompt logprobs ------------------------


def test_byte_level_token_texts(tok):
    texts = TokenTexts(tok)
    assert is_byte_level(tok)
    hello, world = encode(tok, "Hello world")
    assert texts(hello) == ("Hello", None) and texts(world) == (" world", None)  # "Ġworld" mapped back
    assert texts(2) == ("<|im_end|>", None)  # a special token: its content
    assert texts(encode(tok, "é")[0]) == ("é", None)  # a whole two-byte character in one token


def test_token_text_of_a_character_split_across_tokens(tok):
    texts = TokenTexts(tok)
    head, tail = encode(tok, "世")
    (h_text, h_raw), (t_text, t_raw) = texts(head), texts(tail)
    assert h_raw + t_raw == "世".encode() and len(h_raw) == 2 and len(t_raw) == 1
    assert h_text == t_text == "\ufffd"  # decode(errors="replace") of bytes that are not whole UTF-8


def test_token_text_of_a_tokenizer_that_is_not_byte_level():
    class Piece:  # SentencePiece-like: no byte-level backend, decode gives the text
        added_tokens_decoder = {}

        def decode(self, ids, **kw):
            return {5: "▁hi"}.get(ids[0], "?").replace("▁", " ")

    assert not is_byte_level(Piece()) and TokenTexts(Piece())(5) == (" hi", None)


def result(step_id, rids, tokens, tops=None, scores=()):
    """A StepResult; tops: [S, N] (ids, logprobs) rows in rids order."""
    kw = {}
    if tops is not None:
        kw = dict(top_ids=to_wire(np.array(tops[0], np.int32)), top_logprobs=to_wire(np.array(tops[1], np.float32)))
    return StepResult(step_id, tuple(rids), tuple(tokens), tuple(-0.25 for _ in rids), scores=tuple(scores), **kw)


def test_outputs_carry_token_texts_and_each_requests_own_tops(tok):
    detok = Detokenizer(tok)
    hello, world = encode(tok, "Hello world")
    head, tail = encode(tok, "世")
    detok.step([RequestEvents(started=(
        start(rid="texts", top_logprobs=2, logprob_texts=True),
        start(rid="ids", top_logprobs=1),
        start(rid="plain"),
    ))])
    tops = ([[head, hello, 9], [world, 2, 3], [7, 8, 9]], [[-0.1, -1.5, -3.0], [-0.2, -2.5, -4.0], [-1, -2, -3]])
    out, _ = detok.step([result(1, ["texts", "ids", "plain"], [head, world, 7], tops)])
    assert list(out) == ["g"]  # one gateway: one list, one message
    texts, ids, plain = out["g"]
    assert texts.token_texts == ("\ufffd",) and texts.text == ""  # the stream holds the half character
    assert texts.token_raws == ("世".encode()[:2],)  # the sampled token's own bytes
    assert texts.top_logprobs == ((TokenLogprob(head, pytest.approx(-0.1), "\ufffd", "世".encode()[:2]),
                                   TokenLogprob(hello, -1.5, "Hello", None)),)
    assert ids.top_logprobs == ((TokenLogprob(world, pytest.approx(-0.2)),),) and ids.token_texts == ()
    assert plain.top_logprobs == () and plain.token_texts == ()
    out, _ = detok.step([result(2, ["texts"], [tail], ([[tail, 0]], [[-0.3, -9.0]]))])
    (texts,) = out["g"]
    assert texts.text == "世" and texts.token_texts == ("\ufffd",)
    assert texts.top_logprobs[0][0].raw == "世".encode()[2:]
    out, _ = detok.step([result(3, ["texts"], [world])])  # a step where no row asked for tops
    assert out["g"][0].top_logprobs == () and out["g"][0].token_texts == (" world",)
    assert out["g"][0].token_raws == ()  # whole text: no bytes travel


def scores(rid, first, token_ids, logprobs, tops=None):
    kw = {}
    if tops is not None:
        kw = dict(top_ids=to_wire(np.array(tops[0], np.int32)), top_logprobs=to_wire(np.array(tops[1], np.float32)))
    return PromptScores(rid, first, tuple(token_ids), tuple(logprobs), **kw)


def test_prompt_logprobs_accumulate_over_chunks_and_go_out_with_the_first_output(tok):
    detok = Detokenizer(tok)
    prompt = encode(tok, "Hello world, this is")  # scored in two chunks, the second with the first token
    nan = float("nan")
    detok.step([RequestEvents(started=(start(rid="p", top_logprobs=1, logprob_texts=True),))])
    first_chunk = scores("p", 0, prompt[:3], [nan, -1.0, -2.0], ([[-1, -1], [prompt[1], 6], [7, 6]], [[nan, nan], [-1.0, -3], [-0.5, -3]]))
    out, _ = detok.step([result(1, [], [], scores=[first_chunk])])
    assert out == {}  # nothing to send before the first token
    second_chunk = scores("p", 3, prompt[3:], [-3.0] * (len(prompt) - 3), ([[9, 9]] * (len(prompt) - 3), [[-0.1, -0.2]] * (len(prompt) - 3)))
    out, _ = detok.step([result(2, ["p"], [2], ([[2, 3]], [[-0.25, -1.0]]), scores=[second_chunk])])
    (first,) = out["g"]
    assert [p.token_id for p in first.prompt_logprobs] == prompt
    assert math.isnan(first.prompt_logprobs[0].logprob) and first.prompt_logprobs[1].logprob == -1.0
    assert [p.text for p in first.prompt_logprobs] == [tok.convert_ids_to_tokens(i).replace("Ġ", " ") for i in prompt]
    assert len(first.prompt_top_logprobs) == len(prompt) and all(len(t) == 1 for t in first.prompt_top_logprobs[1:])
    assert first.prompt_top_logprobs[0] == () and first.prompt_top_logprobs[1][0].token_id == prompt[1]  # position 0: none
    # NaN survives the wire to the gateway
    (wired,) = wire(OutputBatch((first,)), GatewayInput).outputs
    assert math.isnan(wired.prompt_logprobs[0].logprob)
    out, _ = detok.step([result(3, ["p"], [5])])
    assert out["g"][0].prompt_logprobs == () and out["g"][0].prompt_top_logprobs == ()


def test_prompt_logprobs_without_top_alternatives(tok):
    detok = Detokenizer(tok)
    detok.step([RequestEvents(started=(start(rid="p"),))])
    out, _ = detok.step([result(1, ["p"], [5], scores=[scores("p", 1, [4, 5], [-1.0, -2.0], ([[4], [5]], [[-1.0], [-2.0]]))])])
    (first,) = out["g"]
    assert first.prompt_logprobs == (TokenLogprob(4, -1.0), TokenLogprob(5, -2.0)) and first.prompt_top_logprobs == ()


def test_prompt_logprobs_of_a_request_ended_before_its_first_token(tok):
    detok = Detokenizer(tok)
    detok.step([RequestEvents(started=(start(rid="p"),))])
    detok.step([result(1, [], [], scores=[scores("p", 0, [1, 2], [float("nan"), -2.0])])])
    out, _ = detok.step([RequestEvents(ended=(RequestEnd("p", "g", FinishReason("abort", message="bye")),))])
    (end,) = out["g"]
    assert end.finish.type == "abort" and [p.token_id for p in end.prompt_logprobs] == [1, 2]
    assert math.isnan(end.prompt_logprobs[0].logprob)


def test_a_prefill_only_request_ends_with_its_last_prompt_score(tok):
    """max_new_tokens 0 (the shared stopping.prefill_only rule): no token comes; the score of the
    last prompt position (prompt_tokens 7: position 6) ends it, every score in its one output."""
    detok = Detokenizer(tok)
    detok.step([RequestEvents(started=(start(rid="p", max_new_tokens=0, top_logprobs=1),),
                              cache_hits=(CacheHit("p", 2),))])
    out, _ = detok.step([result(1, [], [], scores=[scores("p", 2, [3, 4, 5], [-1.0] * 3, ([[3]] * 3, [[-1.0]] * 3))])])
    assert out == {}
    last = scores("p", 5, [6, 7], [-2.0, -3.0], ([[6], [7]], [[-2.0], [-3.0]]))
    out, _ = detok.step([msgspec.structs.replace(result(2, [], [], scores=[last]), weight_version="v2")])
    (only,) = out["g"]
    assert only.finish == FinishReason("length", length=0) and only.completion_tokens == 0 and only.cached_tokens == 2
    assert only.text == "" and only.token_ids == () and only.weight_version == "v2"
    assert [p.token_id for p in only.prompt_logprobs] == [3, 4, 5, 6, 7] and len(only.prompt_top_logprobs) == 5
    assert "p" not in detok.requests


def test_a_prefill_only_request_that_scores_nothing_ends_at_the_schedulers_word(tok):
    detok = Detokenizer(tok)
    detok.step([RequestEvents(started=(start(rid="p", max_new_tokens=0),))])
    assert detok.step([result(1, [], [])]) == ({}, {})
    out, _ = detok.step([RequestEvents(ended=(RequestEnd("p", "g", FinishReason("length", length=0)),))])
    (end,) = out["g"]
    assert end.finish == FinishReason("length", length=0) and end.text == "" and end.prompt_logprobs == ()


def test_a_result_of_a_step_before_the_request_started_is_not_its_own(tok):
    """With overlap a step in flight may sample for an ended request; a client that reuses its rid
    must not get that token: results count from the request's replica's first_step on."""
    detok = Detokenizer(tok)
    detok.step([RequestEvents(started=(start(rid="x", first_step=7, replica=1),))])
    stale = [msgspec.structs.replace(result(6, ["x"], [300]), replica=1), result(8, ["x"], [301])]
    out, _ = detok.step(stale)  # the old x's token on replica 1, and another replica's x
    assert out == {}
    out, _ = detok.step([msgspec.structs.replace(result(7, ["x"], [302]), replica=1)])
    assert [o.token_ids for o in out["g"]] == [(302,)]


def _routed(first: int, count: int) -> RoutedExperts:
    """Rows whose every entry is its position: [count, 2 layers, 2 experts]."""
    rows = np.repeat(np.arange(first, first + count, dtype=np.int32), 4).reshape(count, 2, 2)
    return RoutedExperts("r", first, to_wire(rows))


def _result(step_id: int, tokens: list[int], experts: tuple[RoutedExperts, ...]) -> StepResult:
    return StepResult(step_id, ("r",) * len(tokens), tuple(tokens), (-0.5,) * len(tokens), experts=experts)


def test_routed_experts_gather_by_position_and_go_out_with_the_last_output(tok):
    # Prompt of 6, from position 2: a prefill step (rows 2..5 with the cached ones), two decode
    # steps; max 3 tokens, so rows [2, 6 + 3 - 1): the last token never ran.
    detok = Detokenizer(tok)
    detok.step([RequestEvents(started=(start(max_new_tokens=3, routed_experts_from=2, rid="r", prompt_tokens=6),))])
    outs = [detok.step([wire(m, WorkerOutput)])[0]["g"] for m in (_result(0, [10], (_routed(2, 4),)),
                                                                   _result(1, [11], (_routed(6, 1),)),
                                                                   _result(2, [12], (_routed(7, 1),)))]
    assert [o[0].routed_experts is None for o in outs] == [True, True, False]
    rows = from_wire(outs[-1][0].routed_experts)
    assert rows.shape == (6, 2, 2) and rows[:, 0, 0].tolist() == [2, 3, 4, 5, 6, 7]


def test_an_aborted_request_returns_the_rows_that_ran_and_one_that_asked_none_gets_none(tok):
    detok = Detokenizer(tok)
    detok.step([RequestEvents(started=(start(routed_experts_from=0, rid="r", prompt_tokens=6),))])
    detok.step([wire(_result(0, [10], (_routed(0, 6),)), WorkerOutput)])
    end = detok.step([RequestEvents(ended=(RequestEnd("r", "g", FinishReason("abort", message="gone")),))])[0]["g"][0]
    assert from_wire(end.routed_experts)[:, 0, 0].tolist() == [0, 1, 2, 3, 4, 5]  # prompt 6 + 1 token - 1
    plain = Detokenizer(tok)
    plain.step([RequestEvents(started=(start(max_new_tokens=1, rid="r", prompt_tokens=6),))])
    assert plain.step([wire(_result(0, [10], (_routed(0, 6),)), WorkerOutput)])[0]["g"][0].routed_experts is None


def test_token_ids_logprobs_come_per_token_in_the_asked_order_with_prompt_ones_and_ranks(tok):
    """Each token's row [I] of the step's ids_logprobs, cut to the request's own ids, one
    TokenLogprob per id in the asked order (texts when asked); the prompt's likewise with its ranks,
    position 0 (NaN: nothing predicts it) with none; an abort sends what came."""
    detok = Detokenizer(tok)
    hello = encode(tok, "Hello")[0]
    nan = float("nan")
    detok.step([RequestEvents(started=(start(rid="p", token_ids_logprob=(hello, 7), logprob_texts=True),
                                       start(rid="q", gateway="h")))])
    prompt = PromptScores("p", 0, (1, 2, 3), (nan, -1.0, -2.0), ids_logprobs=to_wire(np.array([[nan, nan], [-0.5, -3.0], [-0.25, -4.0]], np.float32)),
                          ranks=to_wire(np.array([0, 2, 1], np.int32)))
    step = StepResult(1, ("p", "q"), (9, 9), (-0.1, -0.1), scores=(prompt,),
                      ids_logprobs=to_wire(np.array([[-1.5, -2.5, 0.0], [0.0, 0.0, 0.0]], np.float32)))  # I = 3: another request's most
    out, _ = detok.step([step])
    (first,) = out["g"]
    assert [[(t.token_id, t.logprob) for t in row] for row in first.token_ids_logprobs] == [[(hello, -1.5), (7, -2.5)]]
    assert first.token_ids_logprobs[0][0].text == "Hello"
    assert first.prompt_ranks == (0, 2, 1)
    assert first.prompt_token_ids_logprobs[0] == ()
    assert [[(t.token_id, t.logprob) for t in row] for row in first.prompt_token_ids_logprobs[1:]] == [[(hello, -0.5), (7, -3.0)],
                                                                                                       [(hello, -0.25), (7, -4.0)]]
    assert out["h"][0].token_ids_logprobs == () and out["h"][0].prompt_ranks == ()  # q asked none
    (wired,) = wire(OutputBatch((first,)), GatewayInput).outputs
    assert wired.token_ids_logprobs == first.token_ids_logprobs
    out, _ = detok.step([RequestEvents(ended=(RequestEnd("p", "g", FinishReason("abort", message="bye")),))])
    assert out["g"][0].finish.type == "abort" and out["g"][0].token_ids_logprobs == ()


def test_results_are_taken_in_step_order_and_outputs_are_numbered(tok):
    """The issue's reordering: a result lost to a stalled read came back a minute later, and its
    token went to the end of the text (... 3114, 3116, ... 3900, 3115). Results are taken by step
    id per replica; each output of a request carries its number for the gateway to check."""
    detok = Detokenizer(tok)
    detok.step([RequestEvents(started=(start(rid="r", first_step=5),))])
    outputs = [detok.step([result(step, ["r"], [100 + step])])[0]["g"][0] for step in (5, 6)]
    assert [(o.token_ids, o.seq) for o in outputs] == [((105,), 1), ((106,), 2)]
    assert detok.step([result(6, ["r"], [106])]) == ({}, {})  # delivered twice: dropped
    assert detok.step([result(5, ["r"], [105])]) == ({}, {})  # older than the last one taken: dropped
    (third,) = detok.step([result(7, ["r"], [107])])[0]["g"]
    assert third.token_ids == (107,) and third.seq == 3 and third.completion_tokens == 3


def test_a_gap_in_a_replicas_results_fails_the_requests_it_may_have_cut_and_stops_them(tok):
    detok = Detokenizer(tok)
    detok.step([RequestEvents(started=(start(rid="cut", first_step=1), start(rid="other", first_step=1, replica=1)))])
    detok.step([result(1, ["cut"], [101]), wire(StepResult(1, ("other",), (5,), (-0.5,), replica=1), WorkerOutput)])
    detok.step([RequestEvents(started=(start(rid="later", first_step=4),))])
    out, stopped = detok.step([result(4, ["cut", "later"], [104, 204])])  # the results of steps 2 and 3 never came
    (failed, later) = out["g"]
    assert failed.rid == "cut" and failed.token_ids == () and failed.seq == 2
    assert failed.finish == FinishReason("error", message="replica 0's step results did not all reach the detokenizer; "
                                                          "the request was lost, retry it")
    assert stopped == {0: ["cut"]}  # its scheduler stops computing it
    assert (later.rid, later.token_ids, later.seq) == ("later", (204,), 1)  # started after the gap: untouched
    assert set(detok.requests) == {"later", "other"}  # another replica's steps count on their own
    assert detok.step([result(2, ["cut"], [102])]) == ({}, {})  # the lost result, late: never appended


def test_a_request_start_delivered_twice_keeps_the_requests_state(tok):
    detok = Detokenizer(tok)
    events = RequestEvents(started=(start(rid="r", first_step=1),))
    detok.step([events])
    detok.step([result(1, ["r"], [101])])
    detok.step([events])
    (out,) = detok.step([result(2, ["r"], [102])])[0]["g"]
    assert out.completion_tokens == 2 and out.seq == 2
