"""A seeded subset of benchmarks/fuzz.py on the fake stack: requests schemathesis generates from the
gateway's own /openapi.json (valid by the schema and not), on every route and method, and a sample
of the hand-written malformed bodies. None may get a 5xx, hang, or end a stream in a server error;
the stack is healthy and idle after (the long run, and its figures, are in docs/performance.md)."""

from collections import Counter

import pytest

from benchmarks.fuzz import bad, fuzz

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]


@pytest.fixture(scope="module")
def stack(fake_stack):
    return fake_stack


def test_generated_requests_from_openapi_never_get_a_5xx(stack):
    calls, healthy = fuzz(stack, examples=2, seed=17, concurrency=4, timeout_s=30, every=24)
    failures = [f"{c.status} <- {c.request_text()}: {c.answer[:200]}" for c in calls if bad(c)]
    assert not failures, "\n".join(failures)
    assert healthy
    statuses = Counter(c.status for c in calls)
    routes = {c.route for c in calls if c.route}
    assert len(calls) >= 100 and statuses[200] >= 20 and statuses[400] >= 50, statuses
    assert {"/v1/chat/completions", "/generate", "/v1/models/{model}", "/pause_generation", "/openapi.json"} <= routes
