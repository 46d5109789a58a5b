"""A deterministic stand-in for the JAX worker, with arithmetic a test can do by hand.

It honours the same step interface: it writes each step's tokens into a paged "cache" of token ids
through the page table, exactly where the JAX worker writes K and V, and reads the last token of
each sampling request back through the page table. So a wrong page table shows up as wrong tokens.

    next token = (token at the request's last position + 1) % vocab_size
    logprob    = -(next token % 10) / 10
"""

from __future__ import annotations

import time

import numpy as np

from jaxstream.arrays import from_wire
from jaxstream.protocol import Step, StepResult


class FakeEngine:
    def __init__(self, num_pages: int, page_size: int, vocab_size: int, step_delay_ms: float = 0.0) -> None:
        self.cache = np.full((num_pages, page_size), -1, dtype=np.int64)  # [P, page_size] token ids
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.step_delay_s = step_delay_ms / 1000  # to give tests time to act mid-stream
        self.steps = 0

    def stats(self) -> dict[str, int]:
        return {"steps": self.steps}

    def step(self, step: Step) -> StepResult:
        started = time.perf_counter()
        tokens, positions = from_wire(step.tokens), from_wire(step.positions)
        page_table = from_wire(step.page_table)
        rids, sampled, logprobs = [], [], []
        for row, seq in enumerate(step.seqs):
            span = slice(seq.start, seq.start + seq.num_tokens)
            pos = positions[span]
            pages = page_table[row, pos // self.page_size]
            self.cache[pages, pos % self.page_size] = tokens[span]
            if seq.sample:
                last = seq.context_len - 1
                token = int(self.cache[page_table[row, last // self.page_size], last % self.page_size])
                nxt = (token + 1) % self.vocab_size
                rids.append(seq.rid)
                sampled.append(nxt)
                logprobs.append(-(nxt % 10) / 10)
        time.sleep(self.step_delay_s)
        self.steps += 1
        ms = (time.perf_counter() - started) * 1000
        return StepResult(step.step_id, tuple(rids), tuple(sampled), tuple(logprobs), ms)
