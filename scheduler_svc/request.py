"""A request as the scheduler holds it, and what a plan makes of it: the seqs of one step.

Plain state, no policy: the story in core.py says how `Scheduler.plan` and `absorb` move these
fields (the numbers in parentheses, "7.", "8.", are its steps), and its invariants what they hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxstream.protocol import FinishReason, FinishRule, SamplingParams
from scheduler_svc.ngram import NgramIndex
from scheduler_svc.radix import Node

# The token of a seq that follows (PlannedSeq.follows): the worker feeds what the slot sampled last.
FOLLOWS = -1


@dataclass(eq=False)  # identity: two requests are never "equal"
class Request:
    rid: str
    gateway: str
    prompt: list[int]
    sampling: SamplingParams  # carried to the worker; only prompt_logprobs_from is read here
    finish: FinishRule
    detokenizer: str = ""  # the detokenizer instance that turns its tokens into text (opaque here)
    # state
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # [P] this request's KV pages, in position order
    computed: int = 0  # tokens whose KV the worker has been told to write
    # planned steps whose result it waits for, not absorbed yet (0, 1 or 2): each samples its next
    # token, or ends it (the one that feeds the whole prompt of a request that samples nothing, 7.)
    awaiting: int = 0
    slot: int = -1  # while running: where the worker keeps its last sampled token (overlap)
    fed_to: int = 0  # positions below this were fed in some step (high-water mark, kept over retraction)
    scored_to: int = 0  # prompt positions below this were asked to be scored, never to be asked again
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache when it was first fed
    shared: int = 0  # its first `shared` pages are the prefix cache's, pinned through `node`
    node: Node | None = None  # the deepest cache node it pins (the root for none); None: not running
    kv_lost: bool = False  # the worker that computed its KV is gone: nothing of it may be cached
    reused: int = -1  # the cached prefix taken at its latest admission, until its first seq is committed
    overtaken: int = 0  # (lpm) requests admitted before it while it was the head of the queue
    # Times (seconds, the caller's clock: the core reads none) for the request timing histograms:
    # it reached the scheduler, its first step was planned (kept over retraction), its first token
    # was absorbed; -1: not yet.
    arrived: float = 0.0
    scheduled: float = -1.0
    first_token: float = -1.0
    drafted: int = 0  # draft tokens of a step in flight (8.): their positions are written, not computed
    ngrams: NgramIndex | None = None  # its tokens' n-grams, once it drafted (8.)
    # Its LoRA adapter (scheduler_svc/adapters.py): the worker's slot (-1: the base model) and the
    # load's generation, its prefix cache namespace (radix.py; 0: the base model's)
    adapter: int = -1
    namespace: int = 0
    # A hybrid's state saved at a page boundary by a step planned (snapshots.py, 2.): (the state row,
    # the position P it is the state at, the pool's epoch when taken); None: no save pending
    snapshot: tuple[int, int, int] | None = None

    @property
    def prompt_logprobs_from(self) -> int:
        """Score the prompt tokens from this position on; -1: none."""
        return self.sampling.prompt_logprobs_from

    @property
    def scores_prompt(self) -> bool:
        """Its steps score prompt positions: from prompt_logprobs_from to the last one."""
        return 0 <= self.prompt_logprobs_from < len(self.prompt)

    @property
    def prefilled(self) -> bool:
        """Some step fed its tokens: a forward pass ran, or will, whatever happens to it now."""
        return self.fed_to > 0

    @property
    def num_known(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def pending(self) -> int:
        """Known tokens the worker has not been told to compute."""
        return self.num_known - self.computed

    def known(self, start: int, stop: int) -> list[int]:
        """Known tokens [start, stop) of prompt + output, without concatenating the whole sequence."""
        n = len(self.prompt)
        return self.prompt[start:stop] + self.output[max(start - n, 0) : max(stop - n, 0)]


@dataclass(frozen=True)
class PlannedSeq:
    request: Request
    start: int  # position of tokens[0] = tokens computed before this step (not a StepSeq offset)
    tokens: list[int]  # fed this step, at positions start, start + 1, ...
    sample: bool  # after this step every known token is computed, so the next one is sampled
    score_from: int = -1  # StepSeq.score_from: prompt positions from here on are scored; -1: none
    next_token: int = -1  # the prompt token right after this chunk; -1 when the chunk ends the prompt
    first: bool = False  # the request's first fed step ever (its cached_tokens is `start`)
    from_cache: bool = False  # its first step since admission, positions [0, start) from the cache
    # Its one token (FOLLOWS) is the one the request's slot sampled in the step before, whose result
    # was not absorbed when this was planned: the output it samples comes one after that one.
    follows: bool = False
    # The request took its slot in this step (admitted): the worker learns its sampling parameters
    # with this seq and keeps them by slot for the request's later seqs.
    takes_slot: bool = False
    # It feeds the last prompt token of a request that asked for no token (7.): it does not sample,
    # and its result ends the request.
    ends: bool = False
    # The last `drafts` of its tokens are a draft to verify (8.): not known tokens, not computed.
    drafts: int = 0
    # A hybrid's state snapshots (snapshots.py): its chunk ends at the page boundary whose state is
    # kept (`saves`, planned); the rows its linear layers start from and also save into (StepSeq's
    # state_from and state_to, resolved when the plan is final); -1: none.
    saves: bool = False
    state_from: int = -1
    state_to: int = -1

    @property
    def context_len(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class Finished:
    request: Request
    finish: FinishReason


@dataclass(frozen=True)
class StepPlan:
    seqs: list[PlannedSeq]  # decodes first, then prompt chunks; at most one per request
    # Requests ended while planning: alone, they still did not fit in the KV pool ("length"). They
    # are in no seq; the caller reports them. `seqs` may be empty when this is not.
    ended: list[Finished] = field(default_factory=list)


@dataclass
class Planning:
    """The step `Scheduler.plan` is planning: what it holds until the plan is final."""

    budget: int  # tokens left
    seqs: dict[str, PlannedSeq] = field(default_factory=dict)  # by rid, in plan order
    ended: list[Finished] = field(default_factory=list)
    retracted: bool = False
    now: float = 0.0  # the caller's clock (plan's `now`)

