"""The load gauges are current when a client reads them: right after a response (/metrics,
/stats, /v1/loads say nothing runs and the KV cache is back to idle), and while a stream runs
(it is counted, the KV cache in use), as vLLM's tests expect. Before reading them the gateway has
every scheduler write its stats (protocol.WriteStats): whatever ended a request the client saw end
is older than that message on the streams the scheduler reads. No sleeps: each read follows the
response at once."""

import re

import httpx
import pytest

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def stack(fake_stack):
    return fake_stack


def gauge(metrics: str, name: str) -> float:
    """The sum over replicas of a jaxstream gauge in /metrics' text."""
    values = re.findall(rf"^jaxstream:{name}\{{[^}}]*\}} (\S+)$", metrics, re.MULTILINE)
    assert values, name
    return sum(float(v) for v in values)


def load(http: httpx.Client) -> tuple[float, float, float, int, int]:
    """(running, waiting, KV usage) from /metrics, running from /stats and from /v1/loads."""
    metrics = http.get("/metrics").text
    stats = http.get("/stats").json()["scheduler"]
    loads = http.get("/v1/loads").json()["loads"]
    return (gauge(metrics, "num_requests_running"), gauge(metrics, "num_requests_waiting"),
            gauge(metrics, "kv_cache_usage_perc"), sum(s["running"] for s in stats.values()),
            sum(entry["num_running_reqs"] for entry in loads))


LONG = 300  # tokens: the fake worker's stream runs long enough to be seen running


def test_gauges_are_current_during_and_after_each_response(stack, tokenizer_info):
    # Each way a request ends: its length and a stop token (the scheduler reads them in the step result
    # it shares with the detokenizer), a stop string (the detokenizer's stop request reaches it).
    stop = tokenizer_info.tokenizer.decode([3000 + LONG - 1, 3000 + LONG], clean_up_tokenization_spaces=False)
    requests = [{"prompt": [1000], "max_tokens": LONG}, {"prompt": [2000], "max_tokens": 2 * LONG, "stop_token_ids": [2000 + LONG]},
                {"prompt": [3000], "max_tokens": 2 * LONG, "stop": [stop]}]
    with httpx.Client(base_url=stack, timeout=30) as http:
        for i in range(9):
            body = {"model": MODEL, "stream": True, **requests[i % 3]}
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()  # held: an iterator dropped closes the connection (an abort)
                assert next(lines).startswith("data: ")
                running, _, usage, in_stats, in_loads = load(http)  # written when it started, not a heartbeat later
                assert running >= 1 and usage > 0 and in_stats >= 1 and in_loads >= 1, (i, body)
                assert f'"finish_reason": "{("length", "stop", "stop")[i % 3]}"' in "".join(lines)
            assert load(http) == (0, 0, 0.0, 0, 0), (i, body)
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": [5000 + i], "max_tokens": 7})
            assert r.status_code == 200 and load(http) == (0, 0, 0.0, 0, 0)


# The families vLLM's dashboards read, with what each must hold after the requests below.
SCHEDULER_HISTOGRAMS = ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                        "request_inference_time_seconds")
GATEWAY_HISTOGRAMS = ("request_prompt_tokens", "request_generation_tokens", "e2e_request_latency_seconds",
                      "time_to_first_token_seconds")


def scrape(http: httpx.Client) -> dict[str, float]:
    """name{labels but model_name} -> value, summed over replicas, from /metrics parsed by
    prometheus_client's parser (which refuses malformed text)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "replica"))
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


def test_vllm_families_count_what_ran(stack):
    p = "jaxstream:"
    prompt = list(range(1100, 1140))  # 40 tokens: the second time, 32 of them (2 pages) come from the prefix cache
    with httpx.Client(base_url=stack, timeout=30) as http:
        before = scrape(http)
        for body in ({"prompt": prompt, "max_tokens": 5}, {"prompt": prompt, "max_tokens": 3},
                     {"prompt": [7, 8, 9], "max_tokens": 4, "n": 2}):
            assert http.post("/v1/completions", json={"model": MODEL, **body}).status_code == 200
        after = scrape(http)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    finished = 4  # pipeline requests: n=2 is two
    for name in SCHEDULER_HISTOGRAMS + GATEWAY_HISTOGRAMS:
        assert delta[p + name + "_count"] == finished, name
        assert delta[p + name + '_bucket{le=+Inf}'] == finished, name
        assert delta[p + name + "_sum"] >= 0, name
    assert delta[p + "request_generation_tokens_sum"] == 5 + 3 + 4 + 4
    assert delta[p + "request_prompt_tokens_sum"] == 40 + 40 + 3 + 3
    assert delta[p + "request_params_n_count"] == 3 and delta[p + "request_params_n_sum"] == 1 + 1 + 2
    assert delta[p + "request_params_max_tokens_sum"] == 5 + 3 + 4
    assert delta[p + "request_max_num_generation_tokens_count"] == 3
    assert delta[p + "request_max_num_generation_tokens_sum"] == 5 + 3 + 4
    # vLLM's count: each request's whole prompt (its cached part too) and every token it sampled.
    assert delta[p + "iteration_tokens_total_count"] >= 1
    assert delta[p + "iteration_tokens_total_sum"] == (40 + 40 + 3 + 3) + (5 + 3 + 4 + 4)
    assert delta[p + "prefix_cache_queries_total"] == 40 + 40 + 3 + 3 and delta[p + "prefix_cache_hits_total"] == 32
    assert after[p + "prefix_cache_hits_total"] <= after[p + "prefix_cache_queries_total"]
    assert delta[p + "num_preemptions_total"] == 0
    assert after[p + "num_requests_waiting_by_reason{reason=capacity}"] == 0
    assert after[p + "num_requests_waiting_by_reason{reason=deferred}"] == 0
    assert any(k.startswith(p + "cache_config_info{block_size=16,") and "enable_prefix_caching=True" in k for k in after)
