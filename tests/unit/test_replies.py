"""The gateway's reply router: each request's outputs reach its queue in their numbered order; one
delivered twice is dropped, one missing fails the request with a clean error, never a hole."""

from types import SimpleNamespace

from gateway.replies import Lost, ReplyRouter
from jaxstream.names import Keys
from jaxstream.protocol import FinishReason, RequestOutput


def router() -> ReplyRouter:
    return ReplyRouter(SimpleNamespace(keys=Keys("t"), name="gateway.test", on_restart=lambda listener: None))


def drained(queue) -> list:
    return [queue.get_nowait() for _ in range(queue.qsize())]


def test_outputs_reach_their_request_in_order_and_a_duplicate_is_dropped():
    replies = router()
    queue = replies.open("r")
    first, second = RequestOutput("r", "a", (1,), seq=1), RequestOutput("r", "b", (2,), seq=2)
    for output in (first, first, second, second):
        replies.output(output)
    assert drained(queue) == [first, second]


def test_a_missing_output_fails_the_request_and_what_follows_is_dropped():
    replies = router()
    queue = replies.open("r")
    replies.output(RequestOutput("r", "a", (1,), seq=1))
    replies.output(RequestOutput("r", "c", (3,), seq=3))  # output 2 never came
    replies.output(RequestOutput("r", "d", (4,), seq=4))
    _, lost = drained(queue)
    assert lost == Lost("output 2 of the request never reached the gateway; the request was lost, retry it")


def test_an_unnumbered_end_and_another_requests_outputs_pass():
    replies = router()
    queue, other = replies.open("r"), replies.open("s")
    end = RequestOutput("r", finish=FinishReason("abort", message="bye"))  # its detokenizer no longer held it
    replies.output(end)
    replies.output(RequestOutput("s", "x", (1,), seq=1))
    replies.output(RequestOutput("gone", "y", (1,), seq=5))  # a request whose client left: nowhere to go
    assert drained(queue) == [end] and [o.text for o in drained(other)] == ["x"]
    replies.close("s")
    assert "s" not in replies.next_seq
