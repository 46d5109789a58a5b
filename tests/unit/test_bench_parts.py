"""`jaxstream bench`'s parts that need no jaxstream server: the load, the conversations format, what
counts as a content chunk, the figures made of request timings, the options, the chosen /stats, and
starting and stopping a server process."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from stack.bench import WARMUP_KEY, requests_for, stats
from stack.bench.figures import Run, RequestRecord, figures, short_outputs, summarize
from stack.bench.load import ConversationError, from_conversations, read_conversations, synthetic
from stack.bench.options import parse
from stack.bench.served import BenchError, content, target_names
from stack.bench.stacks import Server, running, serve_names


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

    assert content(completion("a")) == "a" and content(completion("a", "length")) == "a"
    assert content(completion("")) == ""  # a token without text (special, or a held-back partial character)
    assert content(completion("", "length")) is None  # a bare finish
    assert content({"choices": [], "usage": {"completion_tokens": 3}}) is None
    assert content(chat({"role": "assistant", "content": ""})) is None  # the opening
    assert content(chat({"role": "assistant", "content": "Hi"})) == "Hi"
    assert content(chat({"content": "x"})) == "x" and content(chat({"content": ""})) == ""
    assert content(chat({"reasoning_content": "so"})) == "so"
    assert content(chat({}, "stop")) is None


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


def test_serve_stats_and_a_shared_prefix_parse_and_a_served_run_has_no_default_url():
    opts = parse(["worker=fake", "--serve", "scheduler.overlap=true", "--serve", "scheduler.overlap=false 'model.name=a b'",
                  "--serve", "", "--stats", "worker.idle_gap_ms_*,scheduler.running", "--shared-prefix-len", "32"])
    assert opts.serves == [["scheduler.overlap=true"], ["scheduler.overlap=false", "model.name=a b"], []]
    assert (opts.base_url, opts.overrides, opts.rounds, opts.serve_timeout) == (None, ["worker=fake"], 3, 900)
    assert (opts.stats, opts.shared_prefix_len) == (["worker.idle_gap_ms_*", "scheduler.running"], 32)
    assert parse(["--serve", "", "--base-url", "http://h:1"]).base_url == "http://h:1"
    assert (parse([]).serves, parse([]).shared_prefix_len, parse([]).stats) == ([], 0, [])


@pytest.mark.parametrize("args, message", [
    (["--serve", "worker=fake --restart=never"], "--serve 'worker=fake --restart=never': '--restart=never' is not a Hydra override"),
    (["--serve", "worker=fake 'oops"], "--serve \"worker=fake 'oops\": No closing quotation"),
    (["server.port=9000", "--serve", ""], "server.port=9000: jaxstream bench starts each --serve stack on 127.0.0.1"),
    (["--serve", "server.host=0.0.0.0"], "server.host=0.0.0.0: jaxstream bench starts each --serve stack"),
    (["--stats", "worker.step_ms,gpu.x"], "--stats: 'gpu.x' is not ROLE.KEY (ROLE one of gateway, tokenizer,"),
    (["--stats", "worker"], "--stats: 'worker' is not ROLE.KEY"),
    (["--shared-prefix-len", "-1"], "--shared-prefix-len: must be >= 0"),
    (["--serve-timeout", "0"], "--serve-timeout: must be > 0"),
])
def test_a_bad_serve_stats_or_prefix_flag_is_a_usage_error(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_stack_is_named_by_the_overrides_that_tell_it_apart():
    assert serve_names([["worker=fake", "scheduler.overlap=true"], ["worker=fake", "scheduler.overlap=false"]]) == [
        "scheduler.overlap=true", "scheduler.overlap=false"]
    assert serve_names([["worker=fake"], ["worker=fake", "scheduler.speculative=ngram"]]) == [
        "worker=fake", "scheduler.speculative=ngram"]
    assert serve_names([[], ["a=1"]]) == ["defaults", "a=1"]
    assert serve_names([["a=1"], ["a=1"]]) == ["a=1", "a=1 #2"]
    assert serve_names([["a=1", "b=2"]]) == ["a=1 b=2"]


@pytest.mark.parametrize("prompt_format", ["ids", "text"])
def test_a_shared_prefix_starts_every_prompt_the_warm_up_included(prompt_format, tokenizer_info):
    args = ["--shared-prefix-len", "40", "--input-len", "8", "--prompt-format", prompt_format]
    opts = parse(args)
    encode = tokenizer_info.tokenizer.encode if prompt_format == "text" else list
    # two rounds' requests and the warm-up's: the tokens the server sees
    prompts = [encode(r.prompt) for key in ((0, 0), (0, 1), (WARMUP_KEY,)) for r in requests_for(opts, 3, *key)]
    assert all(len(p) == 48 for p in prompts) and requests_for(opts, 1, 0, 0)[0].input_len == 48
    assert all(p[:40] == prompts[0][:40] for p in prompts)
    assert len({tuple(p[40:]) for p in prompts}) == len(prompts)  # each its own after the prefix
    reseeded = requests_for(parse([*args, "--seed", "1"]), 1, 0, 0)[0]
    assert encode(reseeded.prompt)[:40] != prompts[0][:40]  # the prefix is drawn from --seed too
    unshared = [encode(r.prompt) for r in requests_for(parse(args[2:]), 3, 0, 0)]
    assert [len(p) for p in unshared] == [8, 8, 8] and len({p[0] for p in unshared}) > 1


def test_chosen_stats_side_by_side():
    per_target = {
        "a": {"worker": {"worker.0.x": {"idle_gap_ms_p50": 0.25, "idle_gap_ms_p90": 1.5, "step_ms": 3}},
              "scheduler": {"scheduler.0.x": {"spec_decode_acceptance_rate": 0.5}}},
        "b": {"worker": {"worker.1.y": {"idle_gap_ms_p50": 2.0}, "worker.0.y": {"idle_gap_ms_p50": 1.0}}},
        "vllm": {},
    }
    chosen = stats.selected(per_target, ["worker.idle_gap_ms_*", "scheduler.spec_decode_acceptance_rate", "worker.nope"])
    assert chosen["a"] == {"worker.idle_gap_ms_p50": [0.25], "worker.idle_gap_ms_p90": [1.5],
                           "scheduler.spec_decode_acceptance_rate": [0.5], "worker.nope": []}
    assert chosen["b"]["worker.idle_gap_ms_p50"] == [1.0, 2.0]  # by instance name
    assert chosen["vllm"] == {field: [] for field in chosen["a"]}  # a server without /stats
    lines = stats.table(chosen).splitlines()
    assert lines[0].split() == ["/stats", "a", "b", "vllm"]
    assert lines[1].split() == ["worker.idle_gap_ms_p50", "0.25", "1", "/", "2", "-"]
    assert lines[3].split() == ["scheduler.spec_decode_acceptance_rate", "0.5", "-", "-"]
    assert lines[4].split() == ["worker.nope", "-", "-", "-"]


def processes_with(marker: str) -> list[int]:
    """The pids of every process whose command line holds `marker`."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:  # it ended meanwhile
            pass
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_server_that_is_not_ready_in_time_is_stopped_with_all_it_started(tmp_path):
    marker = f"bench-never-ready-{tmp_path.name}"
    # It starts a grandchild that ignores SIGTERM: only the kill of its whole session stops it.
    script = ("import subprocess, sys, time; print('listening nowhere', flush=True); "
              "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"time.sleep(60)', '{marker}']); time.sleep(60)")
    server = Server("never", [sys.executable, "-c", script, marker], "http://127.0.0.1:9")
    said = []
    with pytest.raises(BenchError, match="never: .* was not ready within 1.5 s; its last lines:\nlistening nowhere"):
        with running([server], 1.5, said.append):
            pytest.fail("entered the block")
    assert said[0] == "starting never at http://127.0.0.1:9" and said[-1] == "stopping never"
    assert processes_with(marker) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_server_that_exits_first_says_so_with_its_last_lines():
    server = Server("oops", [sys.executable, "-c", "import sys; sys.exit('no model here')"], "http://127.0.0.1:9")
    with pytest.raises(BenchError, match="oops: .* exited with code 1 before it was ready; its last lines:\nno model here"):
        with running([server], 60, lambda message: None):
            pytest.fail("entered the block")
