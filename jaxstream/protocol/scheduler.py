"""-> scheduler: requests ready to schedule (from the tokenizer), aborts (gateway), stop-string
finishes (detokenizer), and the control messages every replica's scheduler takes."""

from __future__ import annotations

import msgspec

from jaxstream.protocol.control import (
    ContinueGeneration, FlushCache, LoadAdapter, Memory, PauseGeneration, UnloadAdapter, UpdateWeights, WeightGroup, WriteStats,
)
from jaxstream.protocol.request import FinishRule, SamplingParams


class TokenizedRequest(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """A request ready to schedule, with its finish rule resolved."""

    rid: str
    gateway: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    finish: FinishRule


class AbortRequests(msgspec.Struct, frozen=True, tag=True):
    """Client gone, or an admin abort. Idempotent; may arrive before the request itself."""

    rids: tuple[str, ...]
    message: str = "aborted"
    abort_all: bool = False  # every request the scheduler holds, whoever sent it (`rids` ignored)


class StopRequests(msgspec.Struct, frozen=True, tag=True):
    """The detokenizer matched a stop string: the scheduler ends these requests (no output needed)."""

    rids: tuple[str, ...]


SchedulerInput = (TokenizedRequest | AbortRequests | StopRequests | FlushCache | PauseGeneration | ContinueGeneration
                  | UpdateWeights | Memory | WriteStats | WeightGroup | LoadAdapter | UnloadAdapter)
