"""scheduler -> worker: one step for the whole batch; worker -> scheduler and detokenizers: one
result per step.

Legend: T tokens in the step, R requests (rows) in the step, P pages per request row, A alternatives
per token (top logprobs), I ids of a request's token_ids_logprob, L layers, k experts per token.
"""

from __future__ import annotations

import msgspec

from jaxstream.protocol.control import ControlReply, LoadAdapter, Memory, UpdateWeights, WeightGroup
from jaxstream.protocol.request import SamplingParams
from jaxstream.protocol.wire import Array

MAX_BANNED_TOKENS = 16  # the worker's sampler masks up to this many token ids per request
MAX_TOP_LOGPROBS = 20  # the device's fixed width of alternatives per token (OpenAI's limit); server.max_logprobs may be more
MAX_TOKEN_IDS_LOGPROB = 64  # most ids of a request's token_ids_logprob (the device gathers this many per row)


class StepSeq(msgspec.Struct, frozen=True, array_like=True):
    """One request's share of a step. Its tokens are `tokens[start : start + num_tokens]`."""

    rid: str
    start: int  # offset into Step.tokens
    num_tokens: int  # query length this step (prompt chunk, or 1 for decode)
    context_len: int  # tokens in the cache after this step, this step's included
    sample: bool  # False for a prompt chunk that is not the prompt's last
    # The request's sampling parameters, on its first seq since it took its slot: the worker keeps
    # them by slot for its later seqs. None: the slot's, as kept.
    sampling: SamplingParams | None = None
    # Token ids this step must not sample: the request's stop tokens while it has fewer than
    # min_new_tokens tokens (vLLM's min_tokens). At most MAX_BANNED_TOKENS.
    banned: tuple[int, ...] = ()
    prompt_len: int = 0  # the request's prompt length: positions below it are prompt, the rest output
    # Score (return the logprobs of) the prompt tokens at positions q >= score_from that this step
    # covers: those of the window a step feeding [p0, context_len) can score (jaxstream.scoring:
    # q in [p0 + 1, context_len], q = 0 too when p0 == 0, with logprob NaN). -1: none. The scheduler
    # never asks for a position twice (a recompute after preemption skips those already scored).
    score_from: int = -1
    # The known token right after this step's tokens, when it is a prompt token (the next chunk's
    # first): this step's last logits score it. -1 otherwise.
    next_token: int = -1
    # [p0] int32: the request's tokens at positions [0, p0), which this step does not feed: set on
    # its first step since admission when the prefix cache gave it those positions and its sampling
    # reads earlier tokens (SamplingParams.reads_output: penalties, a constraint), for the worker's token
    # history and matcher. None otherwise.
    history: Array | None = None
    # The request's slot, in [0, scheduler max running requests): the worker keeps the token each
    # slot's last sampling row drew, on the device. -1: none (the worker keeps nothing for the seq).
    slot: int = -1
    # Overlap: the step was planned before the previous step's result arrived, and this seq's one
    # token (its value in Step.tokens is meaningless) is the one its slot sampled in the previous
    # step; the worker reads it there, on the device.
    follows: bool = False
    # Speculative decoding: the last `drafts` of its tokens are a draft (the scheduler's guess of
    # the tokens that follow its first), fed to be verified. The step samples at each of its last
    # drafts + 1 tokens, and its result brings the sampled tokens up to and including the first
    # that differs from the draft's token at the same position (all drafts + 1 when none does), as
    # consecutive rows of its rid. Never with `follows` or `banned`; its slot keeps nothing (the
    # request's next seq does not follow).
    drafts: int = 0
    # The request's LoRA adapter slot (worker.lora), sent with `sampling` (once per admission) and
    # kept by slot with it; -1: the base model. Only meaningful where `sampling` is set.
    adapter: int = -1
    # A hybrid model's state snapshots (scheduler_svc/snapshots.py), rows in [0, scheduler
    # state_snapshots) kept beside the worker's request slots: the row whose state (convolution and
    # recurrent, every linear layer) the seq's first token starts from instead of its slot's (its
    # request's prefix cache hit ends there), and a row its last token's state is saved into as well
    # as into its slot (the state at context_len, a page boundary the prefix cache keeps). -1: none.
    state_from: int = -1
    state_to: int = -1


class Step(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    step_id: int
    seqs: tuple[StepSeq, ...]
    tokens: Array  # [T] int32
    positions: Array  # [T] int32
    page_table: Array  # [R, P] int32, row r = seqs[r]'s pages in order; -1 pads


WorkerInput = Step | UpdateWeights | Memory | WeightGroup | LoadAdapter


class PromptScores(msgspec.Struct, frozen=True, array_like=True):
    """Logprobs of one request's prompt tokens scored in a step (StepSeq.score_from)."""

    rid: str
    first: int  # position of the first scored token; the rest follow contiguously
    token_ids: tuple[int, ...]  # the scored prompt tokens
    logprobs: tuple[float, ...]
    top_ids: Array | None = None  # [n, A] int32, best first; A >= the request's top_logprobs
    top_logprobs: Array | None = None  # [n, A] float32
    # [n, I] float32: each scored position's logprobs of the request's token_ids_logprob (I >= their count)
    ids_logprobs: Array | None = None
    ranks: Array | None = None  # [n] int32: each scored token's rank in its distribution (1: the most likely)


class RoutedExperts(msgspec.Struct, frozen=True, array_like=True):
    """The experts each MoE layer chose for one request's positions in a step: rows for positions
    first, first + 1, ... contiguous. A request's first step also brings the rows of the prompt
    positions the prefix cache gave it (kept per cache slot on the device). Dense layers' rows are
    0, as SGLang's (its buffer is zeros and only MoE layers write theirs)."""

    rid: str
    first: int  # position of the first row
    ids: Array  # [n, L, k] int32: L every hidden layer, k experts per token, in the router's order (best first)


class StepResult(msgspec.Struct, frozen=True, tag=True):
    """One message per step: the sampled token of every seq with `sample=True`, in step order: one
    row each, or, for a seq with drafts, its verified tokens as consecutive rows of the same rid, in
    position order. Every per-row field has a row for each."""

    step_id: int
    rids: tuple[str, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # float32 log-probability of each sampled token
    step_ms: float = 0.0  # device time of the step
    # The most likely tokens of each sampled row, best first, when some row asked for
    # alternatives: [R, A] with R = len(rids) and A the step's largest top_logprobs (a row takes
    # its first top_logprobs). None when no row asked.
    top_ids: Array | None = None  # [R, A] int32
    top_logprobs: Array | None = None  # [R, A] float32
    scores: tuple[PromptScores, ...] = ()
    replica: int = 0  # the worker's replica: step ids count per replica
    weight_version: str = ""  # of the weights that computed the step
    # Routed experts of the seqs whose request asked (SamplingParams.return_routed_experts), from
    # their routed_experts_start_len on; () when none did.
    experts: tuple[RoutedExperts, ...] = ()
    # [R, I] float32: each sampled row's logprobs of its request's token_ids_logprob (the row's first
    # len of them; I the step's most); None when no row asked.
    ids_logprobs: Array | None = None


WorkerOutput = StepResult | ControlReply
