"""`jaxstream bench`'s pure parts: the load, the conversations format, what counts as a content
chunk, and the figures made of request timings. No server."""

import json

import numpy as np
import pytest

from stack.bench.figures import Run, RequestRecord, figures, short_outputs, summarize
from stack.bench.load import ConversationError, from_conversations, read_conversations, synthetic
from stack.bench.options import parse
from stack.bench.served import is_content, target_names


def test_synthetic_ids_are_exact_and_text_is_about_input_len_tokens(tokenizer_info):
    ids, = synthetic(1, 100, 7, "ids", np.random.default_rng(0))
    assert len(ids.prompt) == ids.input_len == 100 and ids.max_tokens == 7 and all(1000 <= i < 30000 for i in ids.prompt)
    text, = synthetic(1, 128, 7, "text", np.random.default_rng(0))
    assert len(tokenizer_info.tokenizer.encode(text.prompt)) == 128


def test_a_request_asks_for_exactly_max_tokens_unless_an_extension_is_dropped():
    request, = synthetic(1, 4, 9, "ids", np.random.default_rng(1))
    assert request.body(0.0, {}) == {"prompt": request.prompt, "max_tokens": 9, "temperature": 0.0,
                                     "ignore_eos": True, "min_tokens": 9}
    assert "min_tokens" not in request.body(0.5, {"top_k": 5}, ("ignore_eos",))
    assert request.body(0.5, {"top_k": 5}, ("ignore_eos",))["top_k"] == 5


def test_conversations_in_both_formats(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps([
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                                {"type": "text", "text": "b"}]}],
         "max_tokens": 3},
        {"id": "x", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"},
                                      {"from": "human", "value": "More"}, {"from": "gpt", "value": "ref"}]},
    ]))
    chats = read_conversations(path)
    assert [c.messages for c in chats] == [(("system", "Be brief."), ("user", "ab")),
                                           (("user", "Hi"), ("assistant", "Hello"), ("user", "More"))]
    requests = from_conversations(chats, 3, 16)
    assert [(r.chat, r.max_tokens) for r in requests] == [(True, 3), (True, 16), (True, 3)]
    assert requests[0].body(0.0, {})["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"}]


@pytest.mark.parametrize("data, message", [
    ({"messages": []}, "must hold a non-empty JSON list"),
    ([], "must hold a non-empty JSON list"),
    ([{"prompt": "x"}], "entry 0: expected an object with either 'messages' or 'conversations'"),
    ([{"messages": [{"role": "robot", "content": "x"}]}], "entry 0.messages: each message needs a role"),
    ([{"messages": [{"role": "user", "content": 5}]}], "entry 0.messages: content must be a string"),
    ([{"conversations": [{"from": "human", "value": "x"}]}, {"conversations": [{"from": "alien", "value": "x"}]}],
     "entry 1.conversations: each turn needs 'from'"),
    ([{"messages": [{"role": "system", "content": "x"}]}], "entry 0: has no user turn to answer"),
    ([{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}], "entry 0.max_tokens: must be an integer >= 1"),
])
def test_a_bad_conversations_file_names_the_entry(tmp_path, data, message):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConversationError, match=message.replace("(", r"\(").replace(".", r"\.")):
        read_conversations(path)


def test_content_chunks():
    def completion(text, finish=None):
        return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}

    def chat(delta, finish=None):
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    assert is_content(completion("a")) and is_content(completion("a", "length"))
    assert is_content(completion(""))  # a token without text (special, or a held-back partial character)
    assert not is_content(completion("", "length"))  # a bare finish
    assert not is_content({"choices": [], "usage": {"completion_tokens": 3}})
    assert not is_content(chat({"role": "assistant", "content": ""}))  # the opening
    assert is_content(chat({"role": "assistant", "content": "Hi"}))
    assert is_content(chat({"content": "x"})) and is_content(chat({"content": ""})) and is_content(chat({"reasoning_content": "so"}))
    assert not is_content(chat({}, "stop"))


def test_figures_of_a_run():
    records = [RequestRecord(0.0, ttft_s=0.1, e2e_s=0.5, itl_s=[0.1] * 4, prompt_tokens=10, output_tokens=5, chunks=5, usage=True),
               RequestRecord(0.2, ttft_s=0.3, e2e_s=1.1, itl_s=[0.2] * 4, prompt_tokens=10, output_tokens=5, chunks=5, usage=True),
               RequestRecord(0.3, error="HTTP 503: busy")]
    f = figures(Run("a", 2, 0, 2.0, records))
    assert (f["requests"], f["completed"], f["failed"], f["prompt_tokens"], f["output_tokens"]) == (3, 2, 1, 20, 10)
    assert (f["output_throughput"], f["total_throughput"], f["request_throughput"]) == (5.0, 15.0, 1.0)
    assert f["ttft_p50_ms"] == pytest.approx(200) and f["e2e_p99_ms"] == pytest.approx(500 + 0.99 * 600)
    assert f["itl_p50_ms"] == pytest.approx(150) and f["tpot_mean_ms"] == pytest.approx((100 + 200) / 2)
    empty = figures(Run("a", 1, 0, 1.0, [RequestRecord(0.0, error="x")]))
    assert empty["output_throughput"] == 0 and empty["ttft_p50_ms"] is None
    # A server that ignored ignore_eos: the bench says how many completed requests came up short.
    runs = [Run("a", 2, 0, 2.0, records), Run("b", 2, 0, 2.0, [RequestRecord(0.0, e2e_s=1.0, output_tokens=6)])]
    assert short_outputs(runs, "a", 6) == (2, 2) and short_outputs(runs, "a", 5) == (0, 2) and short_outputs(runs, "b", 6) == (0, 1)


def test_rows_are_medians_over_rounds_and_the_ratio_pairs_rounds():
    def run(target, round_, tokens):
        return Run(target, 8, round_, 1.0, [RequestRecord(0.0, ttft_s=0.1, e2e_s=1.0, output_tokens=tokens)])

    runs = [run("a", 0, 100), run("b", 0, 90), run("a", 1, 200), run("b", 1, 190), run("a", 2, 300), run("b", 2, 150)]
    a, b = summarize(runs, ["a", "b"], [8], reference="a")
    assert (a.rounds, a.figures["output_throughput"], a.ratio) == (3, 200, 1.0)
    assert b.figures["output_throughput"] == 150 and b.ratio == pytest.approx(0.9)  # median of 0.9, 0.95, 0.5
    (alone,) = summarize(runs[:1], ["a"], [8], reference=None)
    assert alone.ratio is None


def test_targets_are_named_by_url_and_options_default_sensibly():
    assert target_names(["http://127.0.0.1:8000", "http://h:1/x", "http://127.0.0.1:8000"]) == [
        "127.0.0.1:8000", "h:1/x", "127.0.0.1:8000 #2"]
    opts = parse([])
    assert (opts.base_url, opts.mode, opts.loads, opts.rounds, opts.prompt_format) == ("http://127.0.0.1:8000", "concurrency", [8], 1, "text")
    opts = parse(["--in-process", "model=qwen3_tiny", "--request-rate", "1,2.5", "--base-url", "http://h:8000/v1/"])
    assert (opts.base_url, opts.overrides, opts.mode, opts.loads, opts.rounds) == ("http://h:8000", ["model=qwen3_tiny"], "rate", [1, 2.5], 3)
    assert parse(["--in-process"]).base_url is None
