"""The read-back of a step (engine.py): what its executables computed on the device, brought to
the host as one StepResult. One token and one logprob per sampled row; the alternatives and the
named ids' logprobs only when some row asked (cut to the step's largest ask); a draft's rows past
its first token that differs from the draft's dropped (drafts.py); the prompt scores (scoring.py).

Shapes in the legend of worker_svc/__init__.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from jaxstream.arrays import to_wire
from jaxstream.protocol import MAX_TOP_LOGPROBS, SamplingParams, Step, StepResult
from worker_svc.batch import SubStep
from worker_svc.drafts import kept_rows
from worker_svc.inputs import StepInputs
from worker_svc.layers.sampling import Sampled, top_count
from worker_svc.scoring import prompt_scores


@dataclass
class Outputs:
    """What a step's executables computed, on the device, in sub-step order."""

    rids: list[str] = field(default_factory=list)  # the sampled rows' requests, in row order
    sampled: list[tuple[SubStep, Sampled, jax.Array | None]] = field(default_factory=list)  # with the logits [R, V] when kept
    scored: list[tuple[SubStep, tuple[jax.Array, ...]]] = field(default_factory=list)  # the prompt scores' outputs
    # The routed experts capture's part (routed.py): the slots of the seqs that asked for them, the
    # prefixes their cache hit skipped, and each sub-step's inputs and chosen experts [L, T, k]
    wanted: dict[int, int] = field(default_factory=dict)
    prefixes: list[Any] = field(default_factory=list)
    routed: list[tuple[StepInputs, jax.Array]] = field(default_factory=list)
    # The width the step's samplers and prompt scorers ran at (executables.py: the fixed one, or `wide`)
    top_width: int = MAX_TOP_LOGPROBS
    score_width: int = MAX_TOP_LOGPROBS


def read_back(step: Step, params: list[SamplingParams], outputs: Outputs, vocab: int) -> tuple[StepResult, list[np.ndarray]]:
    """(The step's StepResult, each kept sampled row's raw logits [V] in result order: empty unless
    the step kept them)."""
    rids, sampled = outputs.rids, outputs.sampled
    token_ids: list[int] = []
    lps: list[float] = []
    tops: list[tuple[np.ndarray, np.ndarray]] = []
    kept: list[np.ndarray] = []
    n_top = min(max((params[i].top_logprobs for sub, _, _ in sampled for i in sub.sampled), default=0),
                top_count(vocab, outputs.top_width))
    n_ids = max((len(params[i].token_ids_logprob) for sub, _, _ in sampled for i in sub.sampled), default=0)
    ids_lps: list[np.ndarray] = []
    for sub, out, logits in sampled:
        n = len(sub.rids)
        token_ids += np.asarray(out.tokens)[:n].tolist()
        lps += np.asarray(out.logprobs)[:n].tolist()
        if n_top:
            tops.append((np.asarray(out.top_ids)[:n, :n_top], np.asarray(out.top_logprobs)[:n, :n_top]))
        if n_ids:  # read back only when some row asked
            ids_lps.append(np.asarray(out.ids_logprobs)[:n, :n_ids])
        if logits is not None:
            kept += list(np.asarray(logits)[:n])
    # A draft's rows past its first differing token are not the request's (drafts.py)
    keep = kept_rows(step, [i for sub, _, _ in sampled for i in sub.sampled], np.asarray(token_ids))
    if keep is None:
        keep = slice(None)
    else:
        rids, token_ids, lps = (np.asarray(x)[keep].tolist() for x in (rids, token_ids, lps))
        kept = [row for row, k in zip(kept, keep) if k]
    top_ids = top_lps = None
    if n_top:
        top_ids = to_wire(np.concatenate([ids for ids, _ in tops])[keep].astype(np.int32))
        top_lps = to_wire(np.concatenate([lp for _, lp in tops])[keep].astype(np.float32))
    ids = to_wire(np.concatenate(ids_lps)[keep].astype(np.float32)) if n_ids else None
    result = StepResult(step.step_id, tuple(rids), tuple(token_ids), tuple(lps), 0.0, top_ids, top_lps,
                        prompt_scores(step, params, outputs.scored, vocab, outputs.score_width), ids_logprobs=ids)
    return result, kept
