"""How many logprob alternatives a request may ask, by vLLM's rule (vllm/sampling_params.py,
SamplingParams._validate_logprobs): -1 asks for the whole vocabulary, and a count past the server's
cap, `server.max_logprobs` (vLLM's --max-logprobs, 20; -1: the vocabulary), is refused in vLLM's
words, which its clients match. The worker computes that many (worker_svc/executables.py, `wide`).

The vocabulary is the tokenizer's (the ids a client can name), asked of its heartbeat only when a
count needs it, and kept: it does not change while the server runs.
"""

from __future__ import annotations

from gateway.errors import ApiError, invalid
from gateway.generation import Pipeline


class LogprobCounts:
    def __init__(self, pipeline: Pipeline, cap: int) -> None:
        self.pipeline = pipeline
        self.cap = cap  # server.max_logprobs
        self._vocab: int | None = None

    async def __call__(self, count: int | None, name: str, kind: str = "sample") -> int | None:
        """`count` as the worker takes it (-1 becomes the vocabulary's size; None and 0 as given),
        or a 400 naming `name` when it is past the cap. `kind`: "sample" (per generated token) or
        "prompt" (per prompt position), as vLLM's message says."""
        if not count:
            return count
        vocab = await self.vocab() if count == -1 or self.cap == -1 else None
        asked = vocab if count == -1 else count
        cap = vocab if self.cap == -1 else self.cap
        if asked > cap:
            raise invalid(f"Requested {kind} logprobs of {asked}, which is greater than max allowed: {cap}", name)
        return asked

    async def vocab(self) -> int:
        if self._vocab is None:
            facts = (await self.pipeline.model_facts()).tokenizer
            if facts is None:
                raise ApiError(503, "No tokenizer is running: the vocabulary's size, which logprobs of -1 ask for, is unknown")
            self._vocab = facts.vocab_size
        return self._vocab
