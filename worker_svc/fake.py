"""A deterministic stand-in for the JAX worker, with arithmetic a test can do by hand.

It offers the worker service what the JAX engine does (engine_api.py's StepEngine). It writes each
step's tokens into a paged "cache" of token ids through the page table, exactly where the JAX
worker writes K and V, and reads the last token of each sampling request back through the page
table. So a wrong page table shows up as wrong tokens.

The fake model after a token a predicts a + 1, a + 2, ... in that order (mod vocab_size), and gives
any token t the logprob lp(t) = -(t % 10) / 10. Its one weight, `shift` (0 at start, and after any
checkpoint is loaded), adds to every prediction; a weight update from tensors may push it
(a 0-d integer tensor named "shift"):

    next token  = (token at the request's last position + 1 + shift) % vocab_size
    a seq that follows (StepSeq.follows) is fed the token its slot sampled last
    a seq with a draft (StepSeq.drafts) samples after each of its last drafts + 1 tokens, and keeps
                the rows up to the first that differs from the draft (drafts.py)
    logprob     = lp(next token)
    alternatives (top_logprobs = n): ids next, next + 1, ..., next + n - 1 (mod vocab_size) with
                logprobs lp(next), lp(next) - 1, ..., lp(next) - (n - 1); StepResult's are [R, A]
                with A the step's largest top_logprobs (a row asking fewer takes its first ones)
    token_ids_logprob: each asked id i gets lp(i), at every sampled row and scored prompt position
                (StepResult's [R, I] with I the step's most ids; 0 where a row asked fewer)
    prompt logprobs (StepSeq.score_from, the JAX worker's positions exactly, see positions.py):
                position q's token t (the fed token at q, or StepSeq.next_token after the step's
                last) gets lp(t), and the alternatives after the token at q - 1, as above; its
                rank is its place in that list of alternatives: (t - a - 1) % vocab_size + 1
                after the token a at q - 1 (the prediction a + 1 ranks 1);
                position 0 gets NaN, alternatives of id -1 and logprob NaN, ids' logprobs NaN, rank 0

LoRA adapters: an adapter of rank r in a slot adds r to every prediction of the requests under it
(StepSeq.adapter, kept by slot): next token = (last + 1 + shift + r) % vocab_size. A PEFT directory
needs its adapter_config.json (r read from it) and an adapter_model.safetensors; a pushed one, its config.

A script, for a test that needs chosen tokens (a Harmony output: tests/pipeline/test_harmony_fake.py):
a pushed 1-d integer tensor named "script" (s0, s1, ...) makes a context that ends with s0 .. si,
for the longest such i, predict s(i + 1) instead; one script for every request, kept until the
next checkpoint (it is no parameter: /list_weights does not name it).

It ignores temperature, top-k/top-p/min-p, penalties, logit bias, allowed_token_ids, raw_logprobs and
processed_logprobs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from jaxstream.arrays import from_wire, to_wire
from jaxstream.config import ConfigError
from jaxstream.model_files import resolve_model_path
from jaxstream.protocol import ModelFacts, PromptScores, Step, StepResult, StepSeq
from worker_svc.drafts import kept_rows
from worker_svc.positions import first_position, scored, scores_position_zero, token_at
from worker_svc.slots import SlotParams
from worker_svc.weights import CheckpointError


def logprob(token: int) -> float:
    return -(token % 10) / 10


class FakeEngine:
    def __init__(self, num_pages: int, page_size: int, vocab_size: int, step_delay_ms: float = 0.0, routed_experts: bool = False) -> None:
        self.cache = np.full((num_pages, page_size), -1, dtype=np.int64)  # [P, Z] token ids
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.step_delay_s = step_delay_ms / 1000  # to give tests time to act mid-stream
        self.steps = 0
        self.last: dict[int, int] = {}  # slot -> the token sampled there last (0 before any, as the JAX worker's)
        self.slot_params = SlotParams()
        self.shift = 0  # the weight
        self.script: tuple[int, ...] = ()  # tokens to write after a context ending with their beginning
        self.staged: tuple[int, tuple[int, ...]] | None = None  # (shift, script)
        self.released: set[str] = set()
        self.lora: dict[int, int] = {}  # adapter slot -> its rank, which it adds to predictions
        # A dense model: with worker.enable_return_routed_experts, a request asking for them gets a 400
        self.facts = ModelFacts(moe_layers=0, enable_return_routed_experts=routed_experts)

    # -- weights and memory (worker_svc/control.py)

    def weight_names(self) -> list[tuple[str, tuple[int, ...], str]]:
        return [("shift", (), "int64")]

    def stage_disk(self, path: str, load_format: str | None = None) -> int:
        try:
            resolve_model_path(path, key="model_path")
        except ConfigError as exc:
            raise CheckpointError(str(exc)) from None
        self.staged = (0, ())
        return 1

    def stage_dummy(self, seed: int) -> int:
        self.staged = (0, ())
        return 1

    def stage_tensors(self, tensors: Iterable[tuple[str, np.ndarray]]) -> int:
        count = 0
        for name, value in tensors:
            value = np.asarray(value)
            shift, script = self.staged or (self.shift, self.script)
            if name == "script" and value.ndim == 1 and np.issubdtype(value.dtype, np.integer):
                script = tuple(int(t) for t in value)
            elif name == "script":
                raise CheckpointError(f"tensor 'script': a 1-d integer tensor, got {value.dtype} {list(value.shape)}")
            elif name != "shift":
                raise CheckpointError(f"no parameter reads tensor {name!r}; the fake model has one, 'shift'")
            elif value.shape != () or not np.issubdtype(value.dtype, np.integer):
                raise CheckpointError(f"tensor 'shift': a 0-d integer tensor, got {value.dtype} {list(value.shape)}")
            else:
                shift = int(value)
            self.staged, count = (shift, script), count + 1
        return count

    def commit_weights(self) -> int:
        if self.staged is None:
            raise ValueError("nothing staged")
        (self.shift, self.script), self.staged = self.staged, None
        self.released.discard("weights")  # whole weights again (the update after a resume brings them)
        return 1

    def discard_weights(self) -> None:
        self.staged = None

    def release(self, tags: set[str]) -> None:
        self.released |= tags
        if "kv_cache" in tags:
            self.cache[:] = -1

    def resume_kv_cache(self) -> None:
        self.released.discard("kv_cache")

    def load_adapter(self, slot: int, path: str) -> int:
        config, tensors = Path(path) / "adapter_config.json", Path(path) / "adapter_model.safetensors"
        if not (config.is_file() and tensors.is_file()):
            raise ValueError(f"{path}: no adapter_config.json and adapter_model.safetensors (not a PEFT directory)")
        return self.load_adapter_tensors(slot, json.loads(config.read_text()), [])

    def load_adapter_tensors(self, slot: int, config: dict, tensors: list[tuple[str, np.ndarray]]) -> int:
        if not isinstance(config.get("r"), int) or config["r"] < 1:
            raise ValueError(f"the adapter's rank r must be a positive integer, got {config.get('r')!r}")
        self.lora[slot] = config["r"]
        return config["r"]

    def stats(self) -> dict[str, int | float]:
        return {"steps": self.steps}

    def step(self, step: Step) -> StepResult:
        if self.released:
            raise RuntimeError(f"a step while the {' and '.join(sorted(self.released))} memory is released")
        started = time.perf_counter()
        tokens, positions = from_wire(step.tokens), from_wire(step.positions)
        page_table = from_wire(step.page_table)
        params = self.slot_params.resolve(step)
        row_seqs, sampled, scores = [], [], []  # per sampled row: its seq, its token
        for row, seq in enumerate(step.seqs):
            span = slice(seq.start, seq.start + seq.num_tokens)
            pos = positions[span]
            pages = page_table[row, pos // self.page_size]
            self.cache[pages, pos % self.page_size] = self.last.get(seq.slot, 0) if seq.follows else tokens[span]
            # the next token after its last one, or after each of a draft's last drafts + 1 (drafts.py)
            for last in range(seq.context_len - 1 - seq.drafts, seq.context_len) if seq.sample else ():
                token = int(self.cache[page_table[row, last // self.page_size], last % self.page_size])
                row_seqs.append(row)
                shift = self.shift + self.lora.get(self.slot_params.adapters[row], 0)
                sampled.append(self._scripted(page_table[row], last) if self.script else (token + 1 + shift) % self.vocab_size)
            if seq.sample and not seq.drafts:
                self.last[seq.slot] = sampled[-1]
            if seq.score_from >= 0:
                prompt = self._prompt_scores(seq, params[row].prompt_alternatives(), params[row].token_ids_logprob, tokens[span])
                if prompt is not None:
                    scores.append(prompt)
        keep = kept_rows(step, row_seqs, np.asarray(sampled))
        if keep is not None:
            row_seqs, sampled = [r for r, k in zip(row_seqs, keep) if k], [t for t, k in zip(sampled, keep) if k]
        rids, logprobs = [step.seqs[r].rid for r in row_seqs], [logprob(t) for t in sampled]
        top_ids = top_lps = None
        wanted = [params[r].top_logprobs for r in row_seqs]
        if max(wanted, default=0) > 0:
            ids, lps = self._alternatives(np.asarray(sampled) - 1, max(wanted))
            top_ids, top_lps = to_wire(ids), to_wire(lps)
        asked = [params[r].token_ids_logprob for r in row_seqs]
        ids_lps = None
        if max(map(len, asked), default=0) > 0:
            rows = np.zeros((len(asked), max(map(len, asked))), np.float32)
            for r, ids in enumerate(asked):
                rows[r, : len(ids)] = [logprob(i) for i in ids]
            ids_lps = to_wire(rows)
        time.sleep(self.step_delay_s)
        self.steps += 1
        ms = (time.perf_counter() - started) * 1000
        return StepResult(step.step_id, tuple(rids), tuple(sampled), tuple(logprobs), ms, top_ids, top_lps, tuple(scores),
                          ids_logprobs=ids_lps)

    def _alternatives(self, after: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """For each token a of `after` [R] (sampled rows or scored positions): ids [R, n] a + 1, a + 2, ...
        and their logprobs [R, n]."""
        ids = (after[:, None] + 1 + np.arange(n)) % self.vocab_size
        first = (after + 1) % self.vocab_size
        lps = np.array([logprob(int(t)) for t in first], np.float32).reshape(-1, 1) - np.arange(n, dtype=np.float32)
        return ids.astype(np.int32), lps.astype(np.float32)

    def _scripted(self, pages: np.ndarray, last: int) -> int:
        """The script's next token after the context up to position `last` (read through its pages);
        the usual prediction where the context ends with no beginning of the script."""
        context = [int(self.cache[pages[q // self.page_size], q % self.page_size])
                   for q in range(max(0, last + 1 - len(self.script)), last + 1)]
        for n in range(min(len(context), len(self.script) - 1), 0, -1):
            if tuple(context[-n:]) == self.script[:n]:
                return self.script[n]
        return (context[-1] + 1 + self.shift) % self.vocab_size

    def _prompt_scores(self, seq: StepSeq, n: int, asked: tuple[int, ...], fed: np.ndarray) -> PromptScores | None:
        """`n`: the request's prompt alternatives; `asked`: its token_ids_logprob."""
        p0 = first_position(seq)
        q = np.arange(scored(seq).start, scored(seq).stop)
        targets = token_at(seq, fed, q)
        predictors = token_at(seq, fed, q - 1)
        lps = np.array([logprob(int(t)) for t in targets], np.float64)
        ids, top = self._alternatives(predictors, n)
        of_ids = np.tile(np.array([logprob(i) for i in asked], np.float32), (len(q), 1))  # [n, I]
        ranks = ((targets - predictors - 1) % self.vocab_size + 1).astype(np.int32)
        first = int(q[0]) if len(q) else p0
        if scores_position_zero(seq):
            first = 0
            targets, lps = np.insert(targets, 0, fed[0]), np.insert(lps, 0, np.nan)
            ids = np.concatenate([np.full((1, n), -1, np.int32), ids])
            top = np.concatenate([np.full((1, n), np.nan, np.float32), top])
            of_ids = np.concatenate([np.full((1, len(asked)), np.nan, np.float32), of_ids])
            ranks = np.insert(ranks, 0, 0)
        if not len(targets):
            return None
        return PromptScores(seq.rid, first, tuple(targets.tolist()), tuple(lps.tolist()),
                            to_wire(ids) if n else None, to_wire(top) if n else None,
                            to_wire(of_ids) if asked else None, to_wire(ranks.astype(np.int32)))
