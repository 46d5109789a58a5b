"""The order of a position's top alternatives as vLLM lays them out (vllm/logprobs.py
append_logprobs_for_next_position: the sampled token first, then the others best first), which a
client zipping entries by index relies on: chat's top_logprobs list and completions' dict."""

from gateway.generation import Result
from gateway.logprobs import ChatLogprobs, CompletionLogprobs
from jaxstream.protocol import TokenLogprob


def result(sampled: int) -> Result:
    """One position whose three best tokens are 1, 2, 3; `sampled` is the token sampled there."""
    tops = (TokenLogprob(1, -0.5, "a"), TokenLogprob(2, -1.0, "b"), TokenLogprob(3, -2.0, "c"))
    by_id = {t.token_id: t for t in tops} | {9: TokenLogprob(9, -5.0, "z")}
    return Result(text=by_id[sampled].text, token_ids=[sampled], logprobs=[by_id[sampled].logprob],
                  token_texts=[by_id[sampled].text], top_logprobs=[tops])


def test_the_sampled_token_comes_first_then_the_others_best_first():
    chat = ChatLogprobs()
    # Sampled among the top: it moves to the front, the others keep their rank order.
    assert [t["token"] for t in chat.of(result(2))["content"][0]["top_logprobs"]] == ["b", "a", "c"]
    # Sampled outside the top 3: it takes the first place of three, as vLLM's _get_top_logprobs.
    assert [t["token"] for t in chat.of(result(9))["content"][0]["top_logprobs"]] == ["z", "a", "b"]
    completion = CompletionLogprobs(3)
    assert list(completion.of(result(2), 0)[0]["top_logprobs"][0].items()) == [("b", -1.0), ("a", -0.5), ("c", -2.0)]
    # The legacy dict holds the sampled token beside the top 3: four keys, the sampled one first.
    assert list(completion.of(result(9), 0)[0]["top_logprobs"][0]) == ["z", "a", "b", "c"]
