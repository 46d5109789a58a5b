"""`jaxstream bench` against the fake-worker stack (`jaxstream up worker=fake`), and in process on
a tiny random model. The fake worker honours ignore_eos and max_tokens exactly, so every count is
known: requests x --output-len output tokens, requests x --input-len prompt tokens (token ids)."""

import json
import subprocess
import sys
from urllib.parse import urlsplit

import pytest

from stack.bench import load, main
from tests.support import ROOT, chat_prompt_ids
from tests.unit.test_bench_parts import processes_with

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
PNG = b"\x89PNG\r\n\x1a\n"
# qwen3_tiny (random weights, SmolLM2's tokenizer) with step shapes that compile in seconds, as
# tests/model/test_model_configs.py's TINY.
TINY = ["model=qwen3_tiny", "worker.compile_cache_dir=null", "worker.token_buckets=[8]", "worker.pair_buckets=[0,256]",
        "scheduler.max_running_requests=2", "scheduler.max_tokens_per_step=8", "scheduler.num_pages=256"]


@pytest.fixture(scope="module")
def stack(fake_stack):
    return fake_stack


def bench(tmp_path, *args: str) -> tuple[int, dict | None]:
    out = tmp_path / "out.json"
    code = main([*args, "--json", str(out)])
    return code, json.loads(out.read_text()) if out.exists() else None


def requests_of(data: dict, target: str | None = None) -> list[dict]:
    return [r for run in data["runs"] if target in (None, run["target"]) for r in run["requests"]]


def test_a_concurrency_sweep_reports_consistent_figures_and_draws_a_png(stack, tmp_path, capsys):
    plot = tmp_path / "out.png"
    code, data = bench(tmp_path, "--base-url", stack, "--concurrency", "1,3", "--num-prompts", "5", "--input-len", "16",
                       "--output-len", "6", "--prompt-format", "ids", "--plot", str(plot))
    assert code == 0
    assert [(r["target"], r["load"], r["rounds"]) for r in data["rows"]] == [(stack.removeprefix("http://"), 1, 1),
                                                                              (stack.removeprefix("http://"), 3, 1)]
    for row in data["rows"]:
        assert (row["requests"], row["completed"], row["failed"]) == (5, 5, 0)
        assert (row["output_tokens"], row["prompt_tokens"]) == (5 * 6, 5 * 16)
        assert row["output_throughput"] > 0 and row["total_throughput"] > row["output_throughput"]
        assert 0 < row["ttft_p50_ms"] <= row["e2e_p50_ms"] and row["ttft_p50_ms"] <= row["ttft_p90_ms"] <= row["ttft_p99_ms"]
        assert row["itl_p50_ms"] > 0 and row["tpot_p50_ms"] > 0
    for r in requests_of(data):
        assert r["error"] is None and r["usage"] and (r["output_tokens"], r["prompt_tokens"]) == (6, 16)
        assert 0 < r["ttft_s"] <= r["e2e_s"] and len(r["itl_s"]) == r["chunks"] - 1 and 1 <= r["chunks"] <= 6
    assert data["targets"][0]["extensions_sent"] == ["ignore_eos", "min_tokens"]
    assert plot.read_bytes().startswith(PNG)
    table = capsys.readouterr().out
    assert "out tok/s" in table and "TTFT ms p50 / p90 / p99" in table and len(table.strip().splitlines()) == 4


def test_compare_url_alternates_the_two_servers_and_gives_a_ratio(stack, tmp_path, capsys):
    code, data = bench(tmp_path, "--base-url", stack, "--compare-url", stack + "/v1", "--concurrency", "2",
                       "--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--rounds", "2")
    assert code == 0
    name = stack.removeprefix("http://")
    assert [(run["target"], run["round"]) for run in data["runs"]] == [(name, 0), (name + " #2", 0), (name, 1), (name + " #2", 1)]
    assert data["reference"] == name
    ratios = {row["target"]: row["ratio"] for row in data["rows"]}
    assert ratios[name] == 1.0 and ratios[name + " #2"] > 0  # the same stack: near 1, but timings are noisy
    assert all(row["output_tokens"] == 4 * 4 for row in data["rows"])
    assert "ratio" in capsys.readouterr().out


def test_a_poisson_run_sends_at_the_seeded_arrival_times(stack, tmp_path):
    code, data = bench(tmp_path, "--base-url", stack, "--request-rate", "40", "--num-prompts", "6", "--input-len", "8",
                       "--output-len", "3", "--seed", "7")
    assert code == 0
    arrivals = load.poisson_arrivals(6, 40.0, load.rng_for(7, 0, 0, 1))
    starts = [r["start_s"] for r in requests_of(data)]
    assert all(a - 1e-3 <= s <= a + 0.5 for a, s in zip(arrivals, starts)), (arrivals, starts)
    assert arrivals[-1] > 0 and data["rows"][0]["output_tokens"] == 6 * 3 and data["options"]["mode"] == "rate"


def test_a_conversations_file_in_both_formats_goes_to_chat_completions(stack, tmp_path, tokenizer_info):
    conversations = tmp_path / "chats.json"
    conversations.write_text(json.dumps([
        {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 3},
        {"conversations": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "Hi! How can I help?"}]},
    ]))
    code, data = bench(tmp_path, "--base-url", stack, "--conversations", str(conversations), "--num-prompts", "4",
                       "--concurrency", "2", "--output-len", "5")
    assert code == 0
    expected = [len(chat_prompt_ids(tokenizer_info.tokenizer, q)) for q in ("Tell me about the sea.", "Hello there")]
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in requests_of(data)] == [(expected[0], 3), (expected[1], 5)] * 2


def test_served_and_in_process_in_one_run_give_the_pipeline_tax(stack, tmp_path, capsys):
    code, data = bench(tmp_path, "--base-url", stack, "--in-process", "worker=fake", "--concurrency", "2",
                       "--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--prompt-format", "ids", "--rounds", "1")
    assert code == 0
    assert data["reference"] == "in-process" and [t["kind"] for t in data["targets"]] == ["http", "in-process"]
    (tax,) = data["pipeline_tax"]
    assert tax["served"] == stack.removeprefix("http://") and tax["ratio"] > 0
    assert requests_of(data, "in-process") and all(r["output_tokens"] == 4 and r["prompt_tokens"] == 8
                                                   for r in requests_of(data, "in-process"))
    assert "pipeline tax at conc 2" in capsys.readouterr().out


def test_serve_starts_a_stack_per_configuration_loads_them_side_by_side_and_stops_them(tmp_path, capsys):
    code, data = bench(tmp_path, "worker=fake", "--serve", "scheduler.prefix_cache=true", "--serve", "scheduler.prefix_cache=false",
                       "--concurrency", "2", "--num-prompts", "4", "--shared-prefix-len", "32", "--input-len", "8",
                       "--output-len", "4", "--prompt-format", "ids", "--rounds", "1",
                       "--stats", "scheduler.prefix_cache_*_total")
    assert code == 0
    names = ["scheduler.prefix_cache=true", "scheduler.prefix_cache=false"]
    assert [(t["name"], t["overrides"]) for t in data["targets"]] == [
        (names[0], ["worker=fake", "scheduler.prefix_cache=true"]), (names[1], ["worker=fake", "scheduler.prefix_cache=false"])]
    assert [(r["target"], r["completed"], r["output_tokens"], r["prompt_tokens"]) for r in data["rows"]] == [
        (name, 4, 4 * 4, 4 * (32 + 8)) for name in names]
    # /stats read after the run (the scheduler's: the gateway has it write them first). Six prompts of
    # 40 tokens each (the probe, the warm-up's, 4 measured); with the cache, all but the probe read
    # the shared prefix's two pages from it.
    hits, queries = "scheduler.prefix_cache_hits_total", "scheduler.prefix_cache_queries_total"
    assert data["stats"] == {names[0]: {hits: [5 * 32], queries: [6 * 40]}, names[1]: {hits: [0], queries: [6 * 40]}}
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "4 requests per run, a 32-token shared prefix + 8 prompt tokens (ids)" in lines[0]
    assert [line.split()[0] for line in lines[2:4]] == names and all(line.split()[-1] != "-" for line in lines[2:4])
    assert lines[6].split() == ["/stats", *names] and lines[7].split() == ["scheduler.prefix_cache_hits_total", "160", "0"]
    for target in data["targets"]:  # the stacks and every service they started are gone
        assert not processes_with(f"server.port={urlsplit(target['url']).port}")


def test_in_process_at_a_request_rate_sends_each_request_at_its_arrival(tmp_path):
    code, data = bench(tmp_path, "--in-process", "worker=fake", "--request-rate", "50", "--num-prompts", "5",
                       "--input-len", "8", "--output-len", "3", "--prompt-format", "ids")
    assert code == 0
    arrivals = load.poisson_arrivals(5, 50.0, load.rng_for(0, 0, 0, 1))
    assert [r["start_s"] for r in requests_of(data)] == pytest.approx(arrivals)
    assert all(0 < r["ttft_s"] <= r["e2e_s"] and r["output_tokens"] == 3 for r in requests_of(data))


def test_in_process_on_a_tiny_model_reports_figures(tmp_path):
    code, data = bench(tmp_path, "--in-process", *TINY, "--concurrency", "2", "--num-prompts", "3", "--input-len", "12",
                       "--output-len", "3", "--warmup", "0")
    assert code == 0
    (target,) = data["targets"]
    assert (target["kind"], target["model"], target["worker"], target["compiles_after_ready"]) == ("in-process", "qwen3-tiny", "jax", 0)
    (row,) = data["rows"]
    assert (row["completed"], row["output_tokens"], row["prompt_tokens"]) == (3, 9, 36) and row["output_throughput"] > 0
    for r in requests_of(data):
        assert 0 < r["ttft_s"] <= r["e2e_s"] and len(r["itl_s"]) == 2 and r["chunks"] == 3


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "0"], "--concurrency: every value must be >= 1"),
    (["--concurrency", "4", "--request-rate", "2"], "not allowed with argument --concurrency"),
    (["--request-rate", "fast"], "--request-rate: expected a comma-separated list of numbers"),
    (["model=qwen3_tiny"], "Hydra overrides configure the --in-process engine"),
    (["--base-url", "localhost:8000"], "expected an http:// or https:// URL"),
    (["--conversations", "/nonexistent/chats.json"], "cannot read"),
    (["--extra-body", "{oops"], "--extra-body: not valid JSON"),
    (["--in-process", "model=nope"], "config error: model=nope: no configs/model/nope.yaml; choose from"),
    (["--serve", "worker=fake", "--serve", "model=nope"], "config error: model=nope: no configs/model/nope.yaml"),
])
def test_a_bad_flag_is_a_clear_error_with_exit_code_2(args, message, capsys):
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_a_bad_conversations_file_names_the_entry(tmp_path, capsys):
    bad = tmp_path / "chats.json"
    bad.write_text(json.dumps([{"messages": [{"role": "user", "content": "hi"}]}, {"conversations": [{"from": "gpt", "value": "x"}]}]))
    assert main(["--conversations", str(bad)]) == 2
    assert "--conversations: entry 1: has no user turn to answer" in capsys.readouterr().err


def test_the_command_exits_2_on_a_bad_flag_without_a_traceback_and_1_when_no_server_answers():
    run = [sys.executable, "-m", "stack", "bench"]
    bad = subprocess.run([*run, "--num-prompts", "-3"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--num-prompts: must be >= 1" in bad.stderr and "Traceback" not in bad.stderr
    gone = subprocess.run([*run, "--base-url", "http://127.0.0.1:9"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and "cannot reach http://127.0.0.1:9/v1/models" in gone.stderr and "Traceback" not in gone.stderr
    helped = subprocess.run([*run, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "--request-rate" in helped.stdout and "ITL" in helped.stdout

