"""Logprobs in the shapes clients parse: OpenAI chat, OpenAI (legacy) completions, SGLang.

What the numbers are (docs/api.md, "Logprobs"): by default the log-probability of each token under the
distribution that sampled it (after penalties, logit bias and temperature, before top-k/top-p/
min-p), over the whole vocabulary, in float32; `logprobs_mode` "raw": under the model's raw
logits; "processed": under the sampling distribution after the top-k/top-p/min-p cut, renormalized.
The texts come from the detokenizer; a token that is only part of a UTF-8 character carries its
bytes (`TokenLogprob.raw`).
"""

from __future__ import annotations

import math

from gateway.generation import Result
from jaxstream.protocol import TokenLogprob


def number(logprob: float) -> float | None:
    """JSON has no NaN or infinity: position 0 of a prompt (nothing predicts it) is null."""
    return logprob if math.isfinite(logprob) else None


def sampled(result: Result) -> list[TokenLogprob]:
    """Each generated token as a TokenLogprob (text and bytes when the request asked for texts)."""
    out = []
    for i, (token, logprob) in enumerate(zip(result.token_ids, result.logprobs)):
        text = result.token_texts[i] if i < len(result.token_texts) else None
        raw = result.token_raws[i] if i < len(result.token_raws) else None
        out.append(TokenLogprob(token, logprob, text, raw))
    return out


def _bytes(token: TokenLogprob) -> list[int]:
    return list(token.raw if token.raw is not None else (token.text or "").encode())


def sampled_first(token: TokenLogprob, tops: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> list[TokenLogprob]:
    """A position's alternatives in vLLM's order: the sampled token first, then the others best
    first (vLLM's logprobs dict per position, vllm/logprobs.py append_logprobs_for_next_position:
    the sampled token's entry is inserted first and a repeat of it among the top-k keeps that place).
    A client zipping a position's entries by index relies on it."""
    return [token, *(t for t in tops if t.token_id != token.token_id)]


class ChatLogprobs:
    """`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`."""

    def __init__(self, as_ids: bool = False) -> None:
        self.as_ids = as_ids  # vLLM's return_tokens_as_token_ids: "token_id:<id>"

    def _name(self, token: TokenLogprob) -> str:
        return f"token_id:{token.token_id}" if self.as_ids else token.text or ""

    def _entry(self, token: TokenLogprob) -> dict:
        return {"token": self._name(token), "logprob": number(token.logprob), "bytes": _bytes(token)}

    def of(self, result: Result) -> dict:
        """Each position's `top_logprobs` as vLLM's (serving_chat.py `_get_top_logprobs`): the first
        top_logprobs entries of `sampled_first`, so a sampled token outside the top k takes the place
        of the k-th."""
        content = []
        for i, token in enumerate(sampled(result)):
            tops = result.top_logprobs[i] if i < len(result.top_logprobs) else ()
            listed = sampled_first(token, tops)[: len(tops)]
            content.append({**self._entry(token), "top_logprobs": [self._entry(t) for t in listed]})
        return {"content": content, "refusal": None}


class CompletionLogprobs:
    """`{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`; with echo,
    the prompt's tokens come first (the first one's logprob null). As OpenAI's legacy API, each
    position's top dict also holds the sampled token: first, then the alternatives best first, as
    vLLM's (serving_completion.py `_create_completion_logprobs`, over `sampled_first`)."""

    def __init__(self, top: int, as_ids: bool = False) -> None:
        self.top = top
        self.as_ids = as_ids

    def _name(self, token: TokenLogprob) -> str:
        return f"token_id:{token.token_id}" if self.as_ids else token.text or ""

    def of(self, result: Result, offset: int, with_prompt: bool = False) -> tuple[dict, int]:
        """(the logprobs object, the text_offset after its last token: where a stream continues)."""
        tokens = list(zip(sampled(result), result.top_logprobs or [()] * len(result.token_ids)))
        if with_prompt:
            prompt_tops = result.prompt_top_logprobs or [()] * len(result.prompt_logprobs)
            tokens = list(zip(result.prompt_logprobs, prompt_tops)) + tokens
        shaped: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, tops in tokens:
            name = self._name(token)
            logprob = number(token.logprob)
            shaped["tokens"].append(name)
            shaped["token_logprobs"].append(logprob)
            if logprob is None:
                shaped["top_logprobs"].append(None)
            else:
                shaped["top_logprobs"].append({self._name(t): t.logprob for t in sampled_first(token, tops[: self.top])})
            shaped["text_offset"].append(offset)
            offset += len(token.text or "")
        return shaped, offset


def sglang_entries(tokens: list[TokenLogprob], with_text: bool) -> list[list]:
    """`[[logprob, token_id, text or null], ...]`, SGLang's meta_info format."""
    return [[number(t.logprob), t.token_id, t.text if with_text else None] for t in tokens]


def vllm_prompt_logprobs(result: Result, top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt position `{token id: {"logprob", "rank", "decoded_token"}}`,
    the prompt's token first, then its `top` most likely alternatives; null at position 0, which
    nothing predicts."""
    shaped: list[dict | None] = []
    for i, token in enumerate(result.prompt_logprobs):
        if number(token.logprob) is None:
            shaped.append(None)
            continue
        rank = result.prompt_ranks[i] if i < len(result.prompt_ranks) else None
        position = {str(token.token_id): {"logprob": token.logprob, "rank": rank, "decoded_token": token.text or ""}}
        alternatives = result.prompt_top_logprobs[i] if i < len(result.prompt_top_logprobs) else ()
        for r, alt in enumerate(alternatives[:top], start=1):
            position.setdefault(str(alt.token_id), {"logprob": alt.logprob, "rank": r, "decoded_token": alt.text or ""})
        shaped.append(position)
    return shaped
