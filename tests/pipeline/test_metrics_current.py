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
